"""The analysis of a run's dumps (``flight_rank<R>.json``, ``fastpar.flight.record``): a pure
function of them. It finds, in each group, the first collective where the member ranks
disagree (another op, shape or dtype, all-to-all split sizes that do not pair up, a rank that
never arrived), reports the earliest of them, which ranks are behind and by how many
collectives, where each rank waits, a cycle of ranks waiting for each other (groups entered
in a different order), and unmatched pipeline sends and receives."""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[tuple[int, ...], str]  # (member ranks, pg name)
MAIN_KINDS = ("tp", "pp", "dp", "cp", "ep")  # a group's name: those of its kinds


@dataclass
class Finding:
    group: str
    seq: int
    op: str
    text: str
    t: float
    order: int  # ties in time: a mismatch before a missing rank

    def __str__(self) -> str:
        op = f" {self.op}" if self.op else " (the ranks run different collectives)"
        return f"group {self.group}: #{self.seq}{op}: {self.text}"


@dataclass
class Analysis:
    """``first``: the earliest disagreement (None when the dumps agree); ``lines``: the whole
    analysis, ``first`` first."""

    first: Finding | None = None
    findings: list[Finding] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.lines)


def ranks_text(ranks) -> str:
    ranks = list(ranks)
    if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}-{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def _who(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _shape(e: dict) -> str:
    sizes = ", ".join(str(list(s)) for s in e["in"])
    dtypes = ",".join(sorted(set(e["in_dtypes"])))
    return f"{sizes} {dtypes}".strip()


def _groups(dumps: dict[int, dict], world: int) -> dict[Key, str]:
    """Every group any rank knows, keyed by (member ranks, pg name), with its label."""
    out: dict[Key, str] = {}
    for d in dumps.values():
        for name, g in d.get("groups", {}).items():
            ranks = tuple(g.get("ranks") or (range(world) if name == "0" else ()))
            if not ranks:
                continue
            kinds = g.get("kinds") or []
            main = [k for k in MAIN_KINDS if k in kinds]
            if kinds:
                label = "/".join(main) if main else kinds[0]
            elif len(ranks) == world:
                label = "world"
            else:
                desc = g.get("desc") or ""
                label = desc if desc and desc != "undefined" else f"pg{name}"
            out.setdefault((ranks, name), label)
    return out


def _norm(op: str) -> str:
    return op.replace("_", "")


def _entries(d: dict, name: str) -> dict[int, dict]:
    """This rank's collectives on pg ``name`` by sequence number, each with its fastpar note
    (``e["note"]``: shape, split sizes, the note's number ``k`` in the group) where it has one."""
    ents = {e["seq"]: dict(e) for e in d.get("collectives", []) if e["group"] == name}
    notes = [n for n in d.get("ring", []) if n.get("kind") == "collective" and n["group"] == name]
    # the notes are the recorded collectives fastpar's comm layer ran: pair them from the
    # newest back, by op and input shape (collectives without a note are skipped)
    i = len(notes) - 1
    for s in sorted(ents, reverse=True):
        if i < 0:
            break
        e, n = ents[s], notes[i]
        if _norm(n["op"]) in _norm(e["op"]) and (not e["in"] or list(e["in"][0]) == n["shape"]):
            e["note"] = n
            i -= 1
    return ents


def _splits(members: list[int], notes: dict[int, dict]) -> str | None:
    """How the split sizes of one all-to-all (``notes``: each member's note) disagree (None:
    they pair up, or they are unknown)."""
    if any(notes.get(r) is None or notes[r].get("in_splits") is None for r in members):
        return None
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            na, nb = notes[a], notes[b]
            sent, expected = na["in_splits"][j], nb["out_splits"][i]
            if sent != expected:
                return (
                    f"rank {a} sends {[sent, *na['shape'][1:]]} to rank {b}, rank {b} expects "
                    f"{[expected, *nb['shape'][1:]]} from rank {a}"
                )
    return None


def _group_finding(label, members, dumps, ents, lasts) -> Finding | None:
    present = [r for r in members if r in dumps]
    if not present:
        return None
    held = [min(ents[r]) for r in present if ents[r]]
    lo = max(held) if len(held) == len(present) else 1
    hi = max(lasts[r] for r in present)
    name = f"{label}{ranks_text(members)}"
    for s in range(lo, hi + 1):
        at = {r: ents[r][s] for r in present if s in ents[r]}
        if not at:
            continue
        t = min(e["t"] for e in at.values())
        by: dict[str, list[int]] = {}
        for r, e in at.items():
            by.setdefault(f"{e['op']} {_shape(e)}", []).append(r)
        op = next(iter(at.values()))["op"]
        if len(by) > 1:
            text = "; ".join(f"{_who(rs)} {what}" for what, rs in by.items())
            same = len({e["op"] for e in at.values()}) == 1
            return Finding(name, s, op if same else "", text, t, 0)
        if op == "all_to_all":
            bad = _splits(members, {r: e.get("note") for r, e in at.items()})
            if bad:
                return Finding(name, s, op, bad, t, 0)
        # a rank dumped before any member entered #s (a live run's ranks are dumped moments
        # apart) may yet arrive: only a rank dumped after it began can be said to be missing
        never = [r for r in present if lasts[r] < s and dumps[r].get("time", t) >= t]
        if never:
            parts = [f"{_who(sorted(at))} {'are' if len(at) > 1 else 'is'} in it"]
            for r in never:
                prev = ents[r].get(lasts[r])
                was = f"#{lasts[r]} {prev['op']}" if prev else "none"
                parts.append(f"rank {r} never arrived (its last here: {was})")
            return Finding(name, s, op, ", ".join(parts), t, 1)
    return None


def _absent_findings(groups, by_rank, partial, known, found: set) -> list[Finding]:
    """Findings about the ranks that did not dump (stopped, dead). A rank gloo aborted left
    its ring file (``partial``): its last note is compared with the same note of the others.
    Else, each dumped rank's last collective in a group with such a rank names it suspect."""
    out, seen = [], set()
    for a, ring in sorted(partial.items()):
        notes = [n for n in ring if n.get("kind") == "collective"]
        if not notes:
            continue
        n = notes[-1]
        key = next((k for k in groups if k[1] == n["group"] and a in k[0]), None)
        if key is None:
            continue
        members, pg = key
        name = f"{groups[key]}{ranks_text(members)}"
        ents = {m: _entries(by_rank[m], pg) for m in members if m in by_rank}
        same = {
            m: next((e for e in es.values() if (e.get("note") or {}).get("k") == n["k"]), None)
            for m, es in ents.items()
        }
        why = known.get(a, "stopped, hung or dead")
        there = {m: e for m, e in same.items() if e is not None}
        if not there:
            continue
        seq, first = next(iter(there.values()))["seq"], next(iter(there.values()))
        notes_of = {m: e["note"] for m, e in there.items()} | {a: n}
        bad = _splits(list(members), notes_of) if n["op"] == "all_to_all" else None
        by: dict[str, list[int]] = {}
        for m, note in sorted(notes_of.items()):
            by.setdefault(f"{note['op']} {note['shape']} {note['dtype']}", []).append(m)
        if bad:
            text = f"{bad} (rank {a}'s side from its ring file: it {why})"
        elif len(by) > 1:
            text = "; ".join(f"{_who(rs)} {w}" for w, rs in by.items())
            text += f" (rank {a}'s from its ring file: it {why})"
        else:  # it got as far as the others there: what it did next is unknown
            continue
        seen.add(name)
        out.append(Finding(name, seq, first["op"], text, first["t"], 0))
    waiting: dict[tuple[int, ...], list[tuple]] = {}  # absent ranks -> who waits where
    for r, d in sorted(by_rank.items()):
        if not d.get("collectives"):
            continue
        last = max(d["collectives"], key=lambda e: (e["t"], e["seq"]))
        for (members, pg), label in groups.items():
            absent = tuple(m for m in members if m not in by_rank)
            name = f"{label}{ranks_text(members)}"
            if pg != last["group"] or r not in members or not absent or name in found | seen:
                continue
            seen.add(name)
            there = [
                m
                for m in members
                if m in by_rank
                and any(
                    e["group"] == pg and e["seq"] == last["seq"] for e in by_rank[m]["collectives"]
                )
            ]
            waiting.setdefault(absent, []).append((name, last, there))
    for absent, places in waiting.items():  # one finding per missing rank(s), groups in order
        places.sort(key=lambda p: p[0])
        name, last, _ = places[0]
        why = "; ".join(
            f"rank {m} sent no dump ({known.get(m, 'stopped, hung or dead')})" for m in absent
        )
        where = ", ".join(
            f"{_who(there)} in {n} #{e['seq']} {e['op']} {_shape(e)}".strip()
            for n, e, there in places
        )
        out.append(
            Finding(name, last["seq"], last["op"], f"{why}; waiting for it: {where}", last["t"], 2)
        )
    return out


def _diverged(label, members, dumps, ents, before: int) -> str | None:
    """The first collective before #``before`` that member ranks issue from other places."""
    present = [r for r in members if r in dumps and ents[r]]
    if len(present) < 2:
        return None
    common = sorted(set.intersection(*(set(ents[r]) for r in present)))
    for s in common:
        if s >= before:
            break
        stacks = {r: list(ents[r][s]["where"] or ["?"]) for r in present}
        if len({tuple(v) for v in stacks.values()}) > 1:  # show the first frame that differs
            depth = min(len(v) for v in stacks.values())
            i = next((i for i in range(depth) if len({v[i] for v in stacks.values()}) > 1), depth)
            where = {r: v[i] if i < len(v) else "?" for r, v in stacks.items()}
            by: dict[str, list[int]] = {}
            for r, w in where.items():
                by.setdefault(w, []).append(r)
            places = "; ".join(f"{_who(rs)} at {w}" for w, rs in by.items())
            return f"  the ranks already differ at #{s} {ents[present[0]][s]['op']}: {places}"
    return None


def _p2p(dumps: dict[int, dict]) -> list[str]:
    out = []
    sends: dict[tuple[int, int], dict[int, dict]] = {}
    recvs: dict[tuple[int, int], dict[int, dict]] = {}
    for r, d in dumps.items():
        for n in d.get("ring", []):
            if n.get("kind") == "send":
                sends.setdefault((r, n["peer"]), {})[n["k"]] = n
            elif n.get("kind") == "recv":
                recvs.setdefault((n["peer"], r), {})[n["k"]] = n
    for a, b in sorted(set(sends) | set(recvs)):
        if a not in dumps or b not in dumps:
            continue
        s, v = sends.get((a, b), {}), recvs.get((a, b), {})
        for k in sorted(set(s) & set(v)):
            if (s[k]["shape"], s[k]["dtype"]) != (v[k]["shape"], v[k]["dtype"]):
                out.append(
                    f"p2p {a}->{b}: message #{k}: rank {a} sends {s[k]['shape']} {s[k]['dtype']}, "
                    f"rank {b} receives {v[k]['shape']} {v[k]['dtype']}"
                )
                break
        ns, nv = max([*s, 0]), max([*v, 0])
        if ns != nv:
            out.append(f"p2p {a}->{b}: rank {a} sent {ns} messages, rank {b} posted {nv} receives")
    return out


def _positions(groups, by_rank) -> dict[int, tuple[str, int, str, tuple]]:
    """Each dumped rank's last collective: (group name, seq, what, group key)."""
    out = {}
    for r, d in by_rank.items():
        if not d.get("collectives"):
            continue
        e = max(d["collectives"], key=lambda e: (e["t"], e["seq"]))
        key = next((k for k in groups if k[1] == e["group"] and r in k[0]), None)
        if key is not None:
            name = f"{groups[key]}{ranks_text(key[0])}"
            out[r] = (name, e["seq"], f"{e['op']} {_shape(e)}", key)
    return out


def analyse(
    dumps: list[dict], world_size: int | None = None, known: dict | None = None
) -> Analysis:
    """The analysis of ``dumps`` (one dict per rank that dumped, or a ``partial`` one of a
    rank's ring file; ``known``: {rank: what the launcher knows of a rank that did not dump,
    e.g. "stopped: SIGSTOP or a debugger"})."""
    known = known or {}
    by_rank = {int(d["rank"]): d for d in dumps if not d.get("partial")}
    partial = {
        int(d["rank"]): d.get("ring", [])
        for d in dumps
        if d.get("partial") and int(d["rank"]) not in by_rank
    }
    world = max([world_size or 0, *(int(d.get("world_size", 1)) for d in dumps)])
    groups = _groups(by_rank, world)
    at = _positions(groups, by_rank)
    result = Analysis()
    behind: list[str] = []
    hints: dict[str, str] = {}
    lasts_of: dict[tuple, dict[int, int]] = {}
    for (members, pg), label in sorted(groups.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        members = list(members)
        ents = {r: _entries(by_rank[r], pg) for r in members if r in by_rank}
        lasts = lasts_of[(tuple(members), pg)] = {r: max([*ents[r], 0]) for r in ents}
        name = f"{label}{ranks_text(members)}"
        f = _group_finding(label, members, by_rank, ents, lasts)
        if f is not None:
            missing = [r for r in lasts if lasts[r] < f.seq]
            if f.order == 1 and all(r in at and at[r][0] != name for r in missing):
                f.order = 3  # they wait in another group: a consequence, unless a cycle
            result.findings.append(f)
            hint = _diverged(label, members, by_rank, ents, f.seq)
            if hint:
                hints[str(f)] = hint
        if lasts and len(set(lasts.values())) > 1:
            top = max(lasts.values())
            late = sorted(r for r in lasts if lasts[r] < top)
            gaps = ", ".join(f"rank {r} by {top - lasts[r]}" for r in late)
            behind.append(f"group {name}: behind #{top}: {gaps}")
    found = {f.group for f in result.findings}
    result.findings += _absent_findings(groups, by_rank, partial, known, found)
    result.findings.sort(key=lambda f: (f.order, f.t))
    waits = {}
    for r, (name, seq, what, key) in at.items():
        lasts = lasts_of.get((tuple(key[0]), key[1]), {})
        others = [m for m in key[0] if m != r and (m not in lasts or lasts[m] < seq)]
        waits[r] = (name, seq, what, others)
    lines = []
    cycle = _cycle(waits)
    if cycle:
        line = (
            "wait cycle: "
            + " -> ".join(f"rank {r} in {waits[r][0]} #{waits[r][1]}" for r in cycle)
            + f" -> rank {cycle[0]}: these ranks enter their groups in a different order"
        )
        if not result.findings or result.findings[0].order == 3:
            lines.append(line)
    if result.findings:
        result.first = result.findings[0]
        lines.append(f"first disagreement: {result.first}")
        if str(result.first) in hints:
            lines.append(hints[str(result.first)])
        lines += [f"also: {f}" for f in result.findings[1:6]]
    else:
        lines.append("the dumps show no disagreement between ranks")
    lines += behind[:8]
    for r in sorted(waits):
        name, s, what, others = waits[r]
        on = f", waiting for {_who(others)}" if others else ""
        lines.append(f"rank {r} is last in {name} #{s} {what.strip()}{on}")
    if cycle and line not in lines:
        lines.append(line)
    lines += _p2p(by_rank)
    for r in range(world):
        if r not in by_rank:
            lines.append(f"no dump from rank {r} ({known.get(r, 'stopped, hung or dead')})")
    result.lines = lines
    return result


def _cycle(waits: dict[int, tuple[str, int, str, list[int]]]) -> list[int] | None:
    """Ranks each waiting for the next (the last for the first), if any."""
    for start in sorted(waits):
        path, r = [], start
        while r in waits and r not in path:
            path.append(r)
            nxt = [o for o in waits[r][3] if o in waits]
            if not nxt:
                break
            r = nxt[0]
        if r in path and len(path) - path.index(r) > 1:
            return path[path.index(r) :]
    return None
