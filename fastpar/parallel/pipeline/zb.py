"""A stage's backward split in two (zero-bubble schedules): B, the gradient of the stage input
(on the critical path), and W, the weight gradients (deferred). Each parameter accumulates once
per micro-batch and each collective runs once; how, and what is refused: docs/pipelines.md
("Zero bubble: B and W")."""

from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

#: custom autograd Functions whose backward may run twice over one graph (pure, context kept; a
#: collective only one every rank of its group reruns alike): by the forward class's name.
#: fastpar.ops.fp8_linear's reruns its gradient's amax max-reduction over TP and both GEMMs
RERUNNABLE = {"_GroupedLinear", "Fp8LinearFunction"}

#: compute the weight-side gradients of torch's matrix products directly (docs/pipelines.md)
DIRECT = True


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def _closure(roots, targets) -> set:
    """Nodes reachable from ``roots`` that reach a node of ``targets`` (iterative DFS)."""
    reach: dict = {}
    stack = [(n, False) for n in roots if n is not None]
    while stack:
        n, expanded = stack.pop()
        if n in reach and not expanded:
            continue
        kids = [c for c, _ in n.next_functions if c is not None]
        if not expanded:
            reach[n] = None
            stack.append((n, True))
            stack += [(c, False) for c in kids if c not in reach]
        else:
            reach[n] = n in targets or any(reach.get(c) for c in kids)
    return {n for n, ok in reach.items() if ok}


class SplitBackward:
    """One micro-batch's backward, split: ``input_grads()`` (B) then ``weights()`` (W)."""

    def __init__(self, roots, grads, inputs) -> None:
        self.roots, self.grads = list(roots), list(grads)
        self.inputs = list(inputs)
        self.captured: dict = {}

    def input_grads(self) -> list:
        """B: the gradients of ``inputs`` (None for one that got none)."""
        root_nodes = [_node(t) for t in self.roots]
        r_set = _closure(root_nodes, {_node(t) for t in self.inputs}) if self.inputs else set()
        self.r_set = r_set
        children: dict = {}  # weight-side child edge -> the node of R it hangs from
        hooks = []
        # in creation order, latest first (a plain backward's order), never the set's: W runs
        # the intermediates' weight sides in this order, so every TP rank issues its
        # collectives (a sequence-parallel norm's weight-gradient all-reduce) in the same order
        for n in _graph_order(r_set):
            out_edges = [(c, k) for c, k in n.next_functions if c is not None and c not in r_set]
            if not out_edges:
                continue
            _check_rerunnable(n)
            for c, k in out_edges:
                if children.setdefault((c, k), n) is not n:
                    raise ValueError(
                        "zb-h1: a parameter is used at two places of one stage's graph (its "
                        f"gradient node {c.name()} has two parents on the activation path); "
                        "the weight-gradient split cannot separate them: use --schedule 1f1b"
                    )
            self.captured[n] = [(c, k) for c, k in out_edges]
            hooks.append(n.register_prehook(self._capture(n)))
        self.grad_in: dict = {}
        try:
            if r_set:
                got = torch.autograd.grad(
                    self.roots, self.inputs, self.grads, retain_graph=True, allow_unused=True
                )
            else:
                got = [None] * len(self.inputs)
        finally:
            for h in hooks:
                h.remove()
        return list(got)

    def _capture(self, n):
        def hook(grad_outputs):
            self.grad_in[n] = grad_outputs

        return hook

    def weights(self, prompt: bool = False) -> None:
        """W: the weight gradients, accumulated into ``.grad`` (hooks fire once each). In one
        engine call at the end, or with ``prompt`` (no gradient-sync hook waits for the end of
        the backward) each intermediate's at once when no two intermediates reach a common
        node on their weight side (docs/pipelines.md)."""
        edges, grads = [], []
        off_path = [_node(t) for t in self.roots if _node(t) not in self.r_set]
        apart = prompt and _leaves_apart(self.captured, off_path, self.r_set)
        for n, out_edges in self.captured.items():
            got = self.grad_in.get(n)
            if got is None:
                continue
            direct = _direct_weight_grads(n, out_edges, got) if DIRECT else None
            if direct is not None:
                mine = [
                    (GradientEdge(c, k), g) for (c, k), g in zip(out_edges, direct, strict=True)
                ]
            else:
                outs = [(GradientEdge(n, i), g) for i, g in enumerate(got) if g is not None]
                if not outs:
                    continue
                kids = [GradientEdge(c, k) for c, k in out_edges]
                with _leaf_hooks_held(out_edges):
                    res = torch.autograd.grad(
                        [e for e, _ in outs], kids, [g for _, g in outs], allow_unused=True
                    )
                mine = [(e, g) for e, g in zip(kids, res, strict=True) if g is not None]
            if apart and mine:
                torch.autograd.backward([e for e, _ in mine], [g for _, g in mine])
                continue
            edges += [e for e, _ in mine]
            grads += [g for _, g in mine]
        for t, g in zip(self.roots, self.grads, strict=True):
            if _node(t) not in self.r_set:  # a root off the activation path: all of it is W
                edges.append(get_gradient_edge(t))
                grads.append(torch.ones_like(t) if g is None else g)
        if edges:
            torch.autograd.backward(edges, grads)
        self.captured = self.grad_in = {}
        self.roots = self.grads = []


@contextlib.contextmanager
def _leaf_hooks_held(edges):
    """The tensor hooks (``register_hook``) of the parameters ``edges`` lead to held back:
    ``autograd.grad`` runs an input's tensor hooks on the gradient it captures there, and W's
    backward into the parameters runs them again (an ``all_reduce_grad`` hook, a MoE expert's
    under sequence parallelism, would sum over TP twice). They run once, in that backward."""
    held = []
    for c, _ in edges:
        p = getattr(c, "variable", None)  # an AccumulateGrad: the parameter itself
        if p is not None and p._backward_hooks:
            held.append((p, p._backward_hooks))
            p._backward_hooks = None
    try:
        yield
    finally:
        for p, hooks in held:  # the same dict: the hooks' handles still remove them
            p._backward_hooks = hooks


def _graph_order(nodes) -> list:
    """``nodes`` (autograd nodes of one graph) latest-created first: the same order on every
    rank that built the same graph. A set's own order follows the nodes' addresses, which two
    ranks' allocation histories make differ."""
    return sorted(nodes, key=lambda n: n._sequence_nr(), reverse=True)


def _direct_weight_grads(n, out_edges, got) -> list | None:
    """The gradients of ``n``'s weight-side edges (``out_edges``, in order), computed as its own
    backward computes them (torch's ``mm_mat2_backward`` and addmm's ``self`` formula, then the
    engine's sum to the input's shape), for a torch matrix product ``n`` of real dense 2-D
    tensors whose weight-side inputs are its matrix and / or, for addmm, its bias leaf; None
    for any other node (it then goes through the engine)."""
    name = n.name()
    if name == "AddmmBackward0":
        mat, bias_at = 2, 0
    elif name == "MmBackward0":
        mat, bias_at = 1, None
    else:
        return None
    slots = [i for i, (c, k) in enumerate(n.next_functions) if c is not None]
    where = {n.next_functions[i]: i for i in slots}
    if len(where) != len(slots) or len(got) != 1 or got[0] is None:
        return None  # one child on two inputs (x @ x), or not one output gradient
    index = [where.get(e) for e in out_edges]
    if not index or not set(index) <= {mat, bias_at}:
        return None
    g = got[0]
    if g.layout != torch.strided or g.dim() != 2 or g.is_complex():
        return None
    alpha, beta = (n._saved_alpha, n._saved_beta) if name == "AddmmBackward0" else (1, 1)
    if mat in index:  # (autograd saves the activation only when the matrix needs a gradient)
        x = n._saved_mat1 if name == "AddmmBackward0" else n._saved_self
        sizes, strides = n._saved_mat2_sym_sizes, n._saved_mat2_sym_strides
        if x is None or x.layout != torch.strided or x.dim() != 2 or x.dtype != g.dtype:
            return None
    out = []
    for (c, _), i in zip(out_edges, index, strict=True):
        if i == mat:
            # a column-major matrix (a Linear's weight.t()) gets its gradient column-major
            dm = g.t().mm(x).t() if strides[0] == 1 and strides[1] == sizes[0] else x.t().mm(g)
            out.append(dm if alpha == 1 else dm * alpha)
            continue
        bias = getattr(c, "variable", None)  # an AccumulateGrad: the bias leaf itself
        if bias is None or bias.dtype != g.dtype:
            return None
        db = g if beta == 1 else g * beta
        out.append(db if db.shape == bias.shape else db.sum_to_size(bias.shape))
    return out


def _leaves_apart(captured: dict, off_path: list, r_set: set) -> bool:
    """Whether the weight-side subgraphs of the intermediates, and that of the roots off the
    activation path (accumulated in the last call), reach disjoint sets of nodes (then each
    can be accumulated on its own and every leaf's hooks still fire once)."""
    seen: set = set()
    groups = [[c for c, _ in out_edges] for out_edges in captured.values()]
    for group in [*groups, [n for n in off_path if n is not None]]:
        mine: set = set()
        stack = list(group)
        while stack:
            c = stack.pop()
            if c in mine:
                continue
            if c in seen or c in r_set:
                return False
            mine.add(c)
            stack += [k for k, _ in c.next_functions if k is not None]
        seen |= mine
    return True


def _check_rerunnable(n) -> None:
    cls = getattr(n, "_forward_cls", None)
    if cls is not None and cls.__name__ not in RERUNNABLE:
        raise ValueError(
            f"zb-h1: the custom autograd Function {cls.__name__} takes a weight and an "
            "activation; its backward would run in both the B and the W pass (a collective "
            "or freed context twice): use --schedule 1f1b for this model"
        )
