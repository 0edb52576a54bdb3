"""Pure-torch references of every op: the CPU path and the oracle of every test and benchmark."""
