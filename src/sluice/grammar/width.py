"""Width: the parse stacks llama.cpp keeps at one point of the output.

llama.cpp samples a constrained token by checking the whole vocabulary against every
parse stack open at that point of the output (one per alternative still possible), so
a token costs about (open stacks) x (vocabulary), on the engine thread that every
stream waits for. The width of a grammar bounds its open stacks from above. It is read
off the GBNF, so every construct counts alike: enum values (written as a trie, they
hold one stack per distinct next character), anyOf/oneOf branches, optional
properties, a pattern's alternatives and ambiguous repetitions, tools.

Alternatives whose texts tell them apart early (JSON values of different types,
properties or enum values that differ within their leading text) are open together
only within that leading text; alternatives that may stay open together (anyOf of
objects, overlapping patterns) count their widths summed. Where parses may run in
different items of a sequence at once (a pattern's "(ab)?(ab)?a"), every position of
those items counts. A stack whose next character may be a space counts twice (see
_weight). Measured in llama.cpp (SmolLM2, one thread): a width of 32 costs 10-20 ms
per token at its widest point; any grammar ~3.5-5 ms; no grammar well under 1 ms.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import accumulate

from sluice.grammar.gbnf import (
    Chars,
    _char_bit,
    _chars_in,
    _Node,
    _parse_gbnf,
    _refs,
)

_NUMBER_START: Chars = _char_bit(ord("-")) | _chars_in(ord("0"), ord("9"))
_SPACE_CHAR: Chars = _char_bit(ord(" "))


def _weight(chars: Chars) -> int:
    """What a stack whose next character is one of ``chars`` counts for.

    Most tokens of a vocabulary start with a space (SmolLM2: 65%): a stack that
    takes a space goes on to check all of those against what follows, and costs
    about twice another.
    """
    return 2 if chars & _SPACE_CHAR else 1


# Rules of llama.cpp's converter whose sentences are single JSON values.
_VALUE_PRIMITIVES = frozenset(
    ["value", "object", "array", "string", "number", "integer", "boolean", "null", "uuid"]
    + [f"{name}-string" for name in ("date", "time", "date-time")]
)


# What every match starts with: characters, each from a set, each maybe absent (a
# ``space``). Two leads tell their expressions apart when no text fits both until one
# of them ends.
_Lead = tuple[tuple[Chars, bool], ...]
_LEAD_MAX = 48


def _divergence(a: _Lead, b: _Lead) -> tuple[int, int] | None:
    """None when some text fits both leads until one of them ends, else how many items
    of each may match before they tell the texts apart.
    """
    n, m = 0, min(len(a), len(b))
    while n < m and a[n] == b[n]:
        n += 1
    if n == m:
        return None
    if not a[n][1] and not b[n][1] and not a[n][0] & b[n][0]:
        return n, n
    seen: set[tuple[int, int]] = set()
    todo = [(n, n)]
    far_a = far_b = n
    while todo:
        i, j = todo.pop()
        if i == len(a) or j == len(b):
            return None
        if (i, j) in seen:
            continue
        seen.add((i, j))
        far_a, far_b = max(far_a, i), max(far_b, j)
        (ra, oa), (rb, ob) = a[i], b[j]
        if oa:
            todo.append((i + 1, j))
        if ob:
            todo.append((i, j + 1))
        if ra & rb:
            todo.append((i + 1, j + 1))
    return far_a, far_b


def _fixed_text(lead: _Lead) -> str:
    """The characters a lead starts with, while each is one fixed character."""
    out: list[str] = []
    for chars, optional in lead:
        if optional or chars & (chars - 1) or chars >> 128:  # not one ASCII character
            break
        out.append(chr(chars.bit_length() - 1))
    return "".join(out)


def _common_lead(leads: list[_Lead]) -> _Lead:
    n = min(map(len, leads))
    for lead in leads[1:]:
        k = 0
        while k < n and lead[k] == leads[0][k]:
            k += 1
        n = k
    return leads[0][:n]


@dataclass(frozen=True, slots=True)
class _Shape:
    """What the width analysis knows of one GBNF expression.

    Stack counts are upper bounds, capped: past the cap only "too many" matters.
    """

    nullable: bool = False
    first: Chars = 0  # characters a non-empty match may start with
    cont: Chars = 0  # characters that may come next inside it where it may also end
    chars: Chars = 0  # every character it may match
    lead: _Lead = ()  # what every match starts with
    whole: bool = False  # the lead is all of it
    enter: int = 0  # stacks opened on entering it
    lead_stacks: tuple[int, ...] = ()  # [k]: most stacks open within the first k lead items
    live: int = 0  # most stacks open inside it
    end: int = 0  # most stacks open inside it where it may end (what follows opens too)
    positions: int = 0  # its distinct stack positions (parses that entered at other offsets)
    value: bool = False  # every match is one JSON value (then maybe whitespace)
    branches: tuple[_Shape, ...] = ()  # its alternatives, through nested alternations


_EMPTY = _Shape(nullable=True, lead=(), whole=True, lead_stacks=(0,))


def _text_of(a: _Shape, b: _Shape) -> bool:
    """Whether two shapes match alike (all but the counts)."""
    return (a.nullable, a.first, a.cont, a.chars, a.lead, a.whole, a.value) == (
        b.nullable,
        b.first,
        b.cont,
        b.chars,
        b.lead,
        b.whole,
        b.value,
    ) and [(x.lead, x.first, x.value) for x in a.branches] == [
        (x.lead, x.first, x.value) for x in b.branches
    ]


def _no_counts(shape: _Shape) -> _Shape:
    return replace(
        shape,
        enter=0,
        lead_stacks=(0,) * (len(shape.lead) + 1),
        live=0,
        end=0,
        positions=0,
        branches=tuple(_no_counts(b) for b in shape.branches),
    )


def _stacks_within(shape: _Shape, k: int) -> int:
    """Most stacks ``shape`` holds within the first ``k`` items of its lead."""
    if not shape.lead_stacks:
        return max(shape.enter, shape.live)
    return shape.lead_stacks[min(k, len(shape.lead_stacks) - 1)]


class _WidthAnalysis:
    """Upper bounds on the parse stacks of the rules of a grammar (see the section note).

    Rules are solved parts first, and a rule is never narrower than a part of it,
    so the analysis stops at the first rule of ``named`` wider than ``limit``
    (``widest``): the innermost one. ``values``: rules known to match single JSON
    values (the converter's schema rules).

    Example::

        _WidthAnalysis(rules, limit=32, named={"root"}).widest  # None, or a rule name
    """

    def __init__(
        self,
        rules: dict[str, str],
        limit: int,
        *,
        named: set[str] | None = None,
        values: set[str] | None = None,
    ) -> None:
        self.cap = limit + 1  # every count stops there: past the limit, only "too many" matters
        self.values = _VALUE_PRIMITIVES | (values or set())
        self.rules = rules
        self.trees: dict[str, _Node] = {}  # parsed as reached
        self.refs: dict[str, list[str]] = {}  # the rules each one refers to
        self.shapes: dict[str, _Shape] = {}
        self._terminals: dict[_Node, _Shape] = {}
        self.widest: str | None = None
        for component in self._components():
            self._solve(component)
            for name in component:
                if (named is None or name in named) and self.width(name) > limit:
                    self.widest = name
                    return

    def width(self, rule: str) -> int:
        shape = self.shapes[rule]
        return max(shape.enter, shape.live)

    def reaches(self, start: str, rule: str) -> bool:
        """Whether ``rule`` is ``start`` or a part of it, at any depth."""
        seen = {start}
        todo = [start]
        while todo:
            name = todo.pop()
            if name == rule:
                return True
            self._tree(name)
            for ref in self.refs[name]:
                if ref not in seen:
                    seen.add(ref)
                    todo.append(ref)
        return False

    # -- rules: a fixed point over each strongly connected component ---------------------

    def _tree(self, name: str) -> _Node:
        tree = self.trees.get(name)
        if tree is None:
            if name not in self.rules:
                raise AssertionError(f"undefined GBNF rule {name}")
            tree = self.trees[name] = _parse_gbnf(self.rules[name])
            self.refs[name] = sorted(_refs(tree))
        return tree

    def _rule(self, name: str) -> _Shape:
        shape = self._shape(self._tree(name))
        if name in self.values:
            branches = tuple(replace(b, value=True) for b in shape.branches)
            shape = replace(shape, value=True, branches=branches)
        return shape

    def _solve(self, component: list[str]) -> None:
        if len(component) == 1 and component[0] not in self.refs[component[0]]:
            self.shapes[component[0]] = self._rule(component[0])
            return
        # Recursive rules: first what they match (nullable, characters, leads, branches),
        # which only grows from nothing; then, with that fixed, the counts from zero, so
        # they settle at the least bound (an early overcount could sustain itself).
        for name in component:
            self.shapes[name] = _Shape()
        for phase in (_text_of, _Shape.__eq__):
            for _ in range(4 * self.cap + 16):
                changed = False
                for name in component:
                    shape = self._rule(name)
                    if not phase(shape, self.shapes[name]):
                        self.shapes[name], changed = shape, True
                if not changed:
                    break
            else:  # no bound found: as wide as it gets
                for name in component:
                    self.shapes[name] = replace(self.shapes[name], live=self.cap)
                return
            if phase is _text_of:
                for name in component:
                    self.shapes[name] = _no_counts(self.shapes[name])

    def _components(self) -> Iterator[list[str]]:
        """Tarjan's strongly connected components, each after those it refers to."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        for start in reversed(self.rules):  # the root last written: parts of it first
            if start in index:
                continue
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            self._tree(start)
            work: list[tuple[str, list[str]]] = [(start, list(self.refs[start]))]
            while work:
                name, todo = work[-1]
                if todo:
                    ref = todo.pop()
                    if ref not in index:
                        index[ref] = low[ref] = len(index)
                        stack.append(ref)
                        on_stack.add(ref)
                        self._tree(ref)
                        work.append((ref, list(self.refs[ref])))
                    elif ref in on_stack:
                        low[name] = min(low[name], index[ref])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[name])
                if low[name] == index[name]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == name:
                            break
                    yield component

    # -- expressions --------------------------------------------------------------------

    def _shape(self, node: _Node) -> _Shape:
        kind = node[0]
        if kind == "ref":
            return self.shapes.get(node[1], _Shape())
        if kind == "seq":
            return self._seq([self._shape(item) for item in node[1]])
        if kind == "alt":
            return self._alt([self._shape(item) for item in node[1]])
        if kind == "rep":
            return self._repeat(self._shape(node[1]), node[2], node[3])
        shape = self._terminals.get(node)
        if shape is None:
            shape = self._terminals[node] = self._terminal(node)
        return shape

    def _terminal(self, node: _Node) -> _Shape:
        if node[0] == "lit":
            text: str = node[1]
            if not text:
                return _EMPTY
            bits = [_char_bit(ord(c)) for c in text]
            chars = 0
            for bit in set(bits):
                chars |= bit
            lead = tuple((bit, False) for bit in bits[:_LEAD_MAX])
            held = list(accumulate([_weight(bit) for bit in bits[: _LEAD_MAX + 1]] + [0], max))
            return _Shape(
                first=bits[0],
                chars=chars,
                lead=lead,
                whole=len(bits) <= _LEAD_MAX,
                enter=held[0],
                lead_stacks=tuple(held[: len(lead) + 1]),
                live=max((_weight(bit) for bit in bits[1:]), default=0),
                positions=min(len(text), self.cap),
            )
        w = _weight(node[1])
        return _Shape(
            first=node[1],
            chars=node[1],
            lead=((node[1], False),),
            whole=True,
            enter=w,
            lead_stacks=(w, w),
            positions=1,
        )

    def _seq(self, items: list[_Shape]) -> _Shape:
        if len(items) == 1:
            return items[0]
        cap, n = self.cap, len(items)
        # What opens on entering items[i:], and whether all of items[i:] may be empty.
        enter = [0] * (n + 1)
        first: list[Chars] = [0] * (n + 1)
        empty_after = [True] * (n + 1)
        for i in range(n - 1, -1, -1):
            x = items[i]
            enter[i] = min(cap, x.enter + (enter[i + 1] if x.nullable else 0))
            first[i] = x.first | first[i + 1] if x.nullable else x.first
            empty_after[i] = x.nullable and empty_after[i + 1]
        live = end = 0
        cont = chars = window = window_len = window_chars = 0
        for i, x in enumerate(items):
            chars |= x.chars
            # Parses in different items at once, where one may end but others go on with
            # a character the next items may start with: a window of items, each holding
            # a parse at any of its positions.
            going_on = window_chars if window_len > 1 else items[i - 1].cont if i else 0
            if window_len and going_on & first[i]:
                window = min(cap, window + max(x.positions, x.live))
                window_chars |= x.chars
                window_len += 1
            else:
                window, window_chars, window_len = x.live, x.chars, 1
            at_end = min(cap, x.end + enter[i + 1])
            live = max(live, x.live, at_end)
            if window_len > 1:
                at_end = max(at_end, min(cap, window + enter[i + 1]))
                live = max(live, at_end)
            if empty_after[i + 1]:
                end = max(end, at_end)
                cont |= x.cont | first[i + 1]
                if window_len > 1:
                    cont |= window_chars
        # The lead: the items' leads while each is all of its item.
        lead: _Lead = ()
        whole = True
        stacks = [enter[0]]
        for i, x in enumerate(items):
            if i:  # where the item before ends and this one opens
                stacks[-1] = max(stacks[-1], min(cap, items[i - 1].end + enter[i]))
            if len(x.lead_stacks) == len(x.lead) + 1:  # a running maximum, as stacks is
                base = stacks[-1]
                stacks += [max(base, s) for s in x.lead_stacks[1:]]
            else:
                for k in range(1, len(x.lead) + 1):
                    stacks.append(max(stacks[-1], _stacks_within(x, k)))
            lead = lead + x.lead
            if len(lead) > _LEAD_MAX:
                lead, whole = lead[:_LEAD_MAX], False
                break
            if not x.whole:
                whole = False
                break
        if not whole:
            while lead and lead[-1][1]:  # what may be absent at its end tells nothing
                lead = lead[:-1]
        return _Shape(
            nullable=empty_after[0],
            first=first[0],
            cont=cont,
            chars=chars,
            lead=lead,
            whole=whole,
            enter=enter[0],
            lead_stacks=tuple(stacks[: len(lead) + 1]),
            live=live,
            end=end,
            positions=min(cap, sum(x.positions for x in items)),
        )

    def _alt(self, items: list[_Shape]) -> _Shape:
        cap = self.cap
        branches: list[_Shape] = []
        for x in items:
            branches.extend(x.branches or (x,))
        if len(branches) == 1:
            return branches[0]
        if len(branches) > cap:  # more than the cap: as wide as it gets
            return self._saturated(branches[: cap + 1])
        matching = [b for b in branches if b.first]
        if len(matching) == 1:  # x | "": x?, as the chains of optional copies are
            return self._repeat(matching[0], 0, 1)
        # Branches that may stay open together past their leads: connected components
        # of "may start alike and their leads do not tell them apart".
        parent = list(range(len(branches)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def first_root(i: int) -> int:
            while first_parent[i] != i:
                first_parent[i] = first_parent[first_parent[i]]
                i = first_parent[i]
            return i

        first_parent = list(range(len(branches)))  # may start alike
        together_to = [0] * len(branches)  # lead items a branch may match beside another

        def pair(i: int, j: int) -> None:
            a, b = branches[i], branches[j]
            if not a.first & b.first:
                return
            if first_root(i) != first_root(j):
                first_parent[first_root(i)] = first_root(j)
            apart = _divergence(a.lead, b.lead)
            if apart is None:
                if root(i) != root(j):
                    parent[root(i)] = root(j)
            else:
                together_to[i] = max(together_to[i], apart[0])
                together_to[j] = max(together_to[j], apart[1])

        # Leads that start with fixed characters (names, enum values) are compared as
        # sorted text: a branch shares the longest start with a neighbour, and only
        # where one such start begins another do the whole leads need comparing.
        texts = [_fixed_text(b.lead) for b in branches]
        order = sorted((i for i, text in enumerate(texts) if text), key=texts.__getitem__)
        for pos, i in enumerate(order):
            text = texts[i]
            for j in order[pos + 1 :]:
                if not texts[j].startswith(text):
                    other, n = texts[j], 0
                    while text[n] == other[n]:  # (neither starts the other)
                        n += 1
                    together_to[i] = max(together_to[i], n)
                    together_to[j] = max(together_to[j], n)
                    if n and first_root(i) != first_root(j):
                        first_parent[first_root(i)] = first_root(j)
                    break
                pair(i, j)
        for i, text in enumerate(texts):
            if not text:
                for j in range(len(branches)):
                    if j != i and (texts[j] or j < i):
                        pair(i, j)
        groups: dict[int, list[_Shape]] = {}
        for i, b in enumerate(branches):
            groups.setdefault(root(i), []).append(b)
        # Branches that may start alike are open together until their leads tell them
        # apart (then each holds what it holds that far), or all along if they never do.
        enter = min(cap, sum(b.enter for b in branches))
        live = enter
        by_first: dict[int, list[int]] = {}
        for i, b in enumerate(branches):
            alone = len(groups[root(i)]) == 1
            held = _stacks_within(b, together_to[i]) if alone else max(b.enter, b.live)
            by_first.setdefault(first_root(i), []).append(held)
        for held_together in by_first.values():
            live = max(live, min(cap, sum(held_together)))
        end = 0
        cont = chars = first = 0
        for group in groups.values():
            for b in group:
                cont |= b.cont
                chars |= b.chars
                first |= b.first
            if len(group) == 1:
                live, end = max(live, group[0].live), max(end, group[0].end)
                continue
            together = min(cap, sum(b.live for b in group))
            live, end = max(live, together), max(end, together)
            # Where one branch may end, others may be anywhere inside theirs. Not so for
            # JSON values other than numbers: a complete value starts no longer one.
            values = all(b.value for b in group)
            for b in group:
                if not values or b.first & _NUMBER_START:
                    cont |= b.chars
        lead = _common_lead([b.lead for b in branches])
        lead_stacks = tuple(
            min(cap, sum(_stacks_within(b, k) for b in branches)) for k in range(len(lead) + 1)
        )
        return _Shape(
            nullable=any(b.nullable for b in branches),
            first=first,
            cont=cont,
            chars=chars,
            lead=lead,
            enter=enter,
            lead_stacks=lead_stacks,
            live=live,
            end=end,
            positions=min(cap, sum(b.positions for b in branches)),
            value=all(b.value for b in branches),
            branches=tuple(branches),
        )

    def _saturated(self, branches: list[_Shape]) -> _Shape:
        first = chars = 0
        for b in branches:
            first, chars = first | b.first, chars | b.chars
        cap = self.cap
        return _Shape(
            nullable=any(b.nullable for b in branches),
            first=first,
            cont=chars,
            chars=chars,
            enter=min(cap, sum(b.enter for b in branches)),
            live=cap,
            end=cap,
            positions=cap,
            branches=tuple(branches),
        )

    def _repeat(self, x: _Shape, lo: int, hi: int | None) -> _Shape:
        if hi == 0:
            return _EMPTY
        if lo == hi == 1:
            return x
        if lo > 1 or (hi is not None and hi > 1):
            # llama.cpp writes x{m,n} as m copies, then nested optional ones.
            tail = self._repeat(x, 0, None) if hi is None else None
            for _ in range((hi or lo) - lo):
                tail = self._repeat(x if tail is None else self._seq([x, tail]), 0, 1)
            return self._seq([x] * lo + ([tail] if tail is not None else []))
        cont = x.cont | x.first
        if hi == 1:  # x?
            single = x.whole and x.lead is not None and len(x.lead) == 1 and not x.nullable
            lead: _Lead = ((x.lead[0][0], True),) if single and x.lead is not None else ()
            return replace(
                x,
                nullable=True,
                cont=cont,
                lead=lead,
                whole=single,
                lead_stacks=(x.enter, x.enter) if single else (x.enter,),
                value=False,
                branches=(),
            )
        cap = self.cap
        if x.nullable or x.cont & x.first:
            # A new copy may start where the last one may also go on: copies open at once.
            live = end = min(cap, max(x.live, x.positions) + x.enter)
        else:
            end = min(cap, x.end + x.enter)
            live = max(x.live, end)
        return replace(
            x,
            nullable=x.nullable or lo == 0,
            cont=cont,
            lead=x.lead if lo else (),
            whole=False,
            lead_stacks=x.lead_stacks if lo else (x.enter,),
            live=live,
            end=end,
            positions=min(cap, x.positions * (lo + 1)),
            value=False,
            branches=(),
        )
