"""The analysis of a run's dumps (``flight_rank<R>.json``, ``fastpar.flight.record``): a pure
function of them. It finds, in each group, the first collective where the member ranks
disagree (another op, shape or dtype, all-to-all split sizes that do not pair up, a rank that
never arrived), reports the earliest of them, which ranks are behind and by how many
collectives, where each rank waits, a cycle of ranks waiting for each other (groups entered
in a different order), and unmatched pipeline sends and receives."""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[tuple[int, ...], str]  # (member ranks, pg name)


@dataclass
class Finding:
    group: str
    seq: int
    op: str
    text: str
    t: float
    order: int  # ties in time: a mismatch before a missing rank

    def __str__(self) -> str:
        return f"group {self.group}: #{self.seq} {self.op}: {self.text}"


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
    sizes = ", ".join(str(list(s)) for s in e["in"]) or "-"
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
            if kinds:
                label = kinds[0]
            elif len(ranks) == world:
                label = "world"
            else:
                desc = g.get("desc") or ""
                label = desc if desc and desc != "undefined" else f"pg{name}"
            out.setdefault((ranks, name), label)
    return out


def _entries(d: dict, name: str) -> dict[int, dict]:
    ents = {e["seq"]: dict(e) for e in d.get("collectives", []) if e["group"] == name}
    a2a = [ents[s] for s in sorted(ents) if ents[s]["op"] == "all_to_all"]
    notes = [n for n in d.get("ring", []) if n.get("kind") == "splits" and n["group"] == name]
    # the k-th noted all-to-all is the k-th recorded one: pair them from the newest back
    i = len(notes) - 1
    for e in reversed(a2a):
        while i >= 0 and e["in"] and notes[i]["rows"] != e["in"][0][0]:
            i -= 1
        if i < 0:
            break
        e["splits"] = notes[i]
        i -= 1
    return ents


def _last(ents: dict[int, dict]) -> int:
    return max([*ents, 0])


def _splits(label, seq, members, at) -> str | None:
    """How the split sizes of an all-to-all disagree (None: they pair up, or unknown)."""
    notes = {r: at[r].get("splits") for r in members if r in at}
    if len(notes) < len(members) or any(n is None for n in notes.values()):
        return None
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            na, nb = notes[a], notes[b]
            if not na["in_splits"] or not nb["out_splits"]:
                continue
            sent, expected = na["in_splits"][j], nb["out_splits"][i]
            if sent != expected:
                width = na["width"]
                return (
                    f"rank {a} sends {[sent, *width]} to rank {b}, rank {b} expects "
                    f"{[expected, *nb['width']]} from rank {a}"
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
            return Finding(
                name, s, op if len({e["op"] for e in at.values()}) == 1 else "op", text, t, 0
            )
        if op == "all_to_all":
            bad = _splits(label, s, members, at)
            if bad:
                return Finding(name, s, op, bad, t, 0)
        never = [r for r in present if lasts[r] < s]
        if never:
            parts = [f"{_who(sorted(at))} {'are' if len(at) > 1 else 'is'} in it"]
            for r in never:
                prev = ents[r].get(lasts[r])
                was = f"#{lasts[r]} {prev['op']}" if prev else "none"
                parts.append(f"rank {r} never arrived (its last here: {was})")
            return Finding(name, s, op, ", ".join(parts), t, 1)
    return None


def _absent_findings(groups, by_rank, known, found: set) -> list[Finding]:
    """For each rank that dumped, its last collective, when its group holds a rank that did
    not dump (stopped, dead): that rank is the suspect."""
    out, seen = [], set()
    for r, d in sorted(by_rank.items()):
        if not d.get("collectives"):
            continue
        last = max(d["collectives"], key=lambda e: (e["t"], e["seq"]))
        for (members, pg), label in groups.items():
            absent = [m for m in members if m not in by_rank]
            name = f"{label}{ranks_text(members)}"
            key = (members, pg, last["seq"])
            if pg != last["group"] or r not in members or not absent or key in seen:
                continue
            if name in found:
                continue
            seen.add(key)
            there = [
                m
                for m in members
                if m in by_rank
                and any(
                    e["group"] == pg and e["seq"] == last["seq"] for e in by_rank[m]["collectives"]
                )
            ]
            why = "; ".join(
                f"rank {a} sent no dump ({known.get(a, 'stopped, hung or dead')})" for a in absent
            )
            text = f"{_who(there)} {_shape(last)}; {why}"
            out.append(Finding(name, last["seq"], last["op"], text, last["t"], 2))
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
        where = {r: (ents[r][s]["where"] or ["?"])[0] for r in present}
        if len(set(where.values())) > 1:
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


def analyse(
    dumps: list[dict], world_size: int | None = None, known: dict | None = None
) -> Analysis:
    """The analysis of ``dumps`` (one dict per rank that dumped; ``known``: {rank: what the
    launcher knows of a rank that did not, e.g. "stopped (SIGSTOP or a debugger)"})."""
    known = known or {}
    by_rank = {int(d["rank"]): d for d in dumps}
    world = max([world_size or 0, *(int(d.get("world_size", 1)) for d in dumps)])
    groups = _groups(by_rank, world)
    result = Analysis()
    behind: list[str] = []
    waits: dict[int, tuple[str, int, str, list[int]]] = {}
    hints: dict[str, str] = {}
    for (members, pg), label in sorted(groups.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        members = list(members)
        ents = {r: _entries(by_rank[r], pg) for r in members if r in by_rank}
        lasts = {r: _last(ents[r]) for r in ents}
        f = _group_finding(label, members, by_rank, ents, lasts)
        if f is not None:
            result.findings.append(f)
            hint = _diverged(label, members, by_rank, ents, f.seq)
            if hint:
                hints[str(f)] = hint
        name = f"{label}{ranks_text(members)}"
        if lasts and len(set(lasts.values())) > 1:
            top = max(lasts.values())
            late = sorted(r for r in lasts if lasts[r] < top)
            gaps = ", ".join(f"rank {r} by {top - lasts[r]}" for r in late)
            behind.append(f"group {name}: behind #{top}: {gaps}")
        for r, e in ents.items():
            pending = [s for s, x in e.items() if not x["done"]]
            if pending:
                s = max(pending)
                others = [m for m in members if m != r and (m not in lasts or lasts[m] < s)]
                if r not in waits or s > waits[r][1]:
                    waits[r] = (name, s, f"{e[s]['op']} {_shape(e[s])}", others)
    result.findings += _absent_findings(groups, by_rank, known, {f.group for f in result.findings})
    result.findings.sort(key=lambda f: (f.t, f.order))
    lines = []
    if result.findings:
        result.first = result.findings[0]
        lines.append(f"first disagreement: {result.first}")
        if str(result.first) in hints:
            lines.append(hints[str(result.first)])
        lines += [f"also: {f}" for f in result.findings[1:6]]
    else:
        lines.append("the dumps show no disagreement between ranks")
    lines += behind[:8]
    for r in sorted(by_rank):
        if r in waits:
            name, s, what, others = waits[r]
            on = f" for {_who(others)}" if others else ""
            lines.append(f"rank {r} waits in {name} #{s} {what}{on}")
    cycle = _cycle(waits)
    if cycle:
        lines.append(
            "wait cycle: "
            + " -> ".join(f"rank {r} ({waits[r][0]} #{waits[r][1]})" for r in cycle)
            + f" -> rank {cycle[0]}: these ranks enter their groups in a different order"
        )
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
