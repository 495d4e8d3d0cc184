"""Match expressions: which devices a job may run on (``targets.match``).

An expression is parsed once by :func:`compile_match` (or the cached :func:`compiled`) into a
:class:`Matcher`, then evaluated against many devices.  Nothing here uses ``eval``/``exec``: a
hand-written tokenizer feeds a recursive-descent parser.

Grammar, loosest binding first::

    expr       := and_expr ( "||" and_expr )*
    and_expr   := unary ( "&&" unary )*
    unary      := "!" unary | "(" expr ")" | comparison
    comparison := operand [ ("==" | "!=" | "<" | "<=" | ">" | ">=" | "~") operand ]
    operand    := field | string | number | "true" | "false"

* ``field``: ``[A-Za-z_][A-Za-z0-9_.]*`` -- a descriptor field (platform, ram_mb, soc, kind, ...),
  ``device_id``, ``pools``, ``capabilities`` or any other key of the view.
* ``string``: single or double quotes.  ``\\\\``, ``\\'`` and ``\\"`` are escapes; any other
  backslash is kept as written, so regular expressions read naturally (``'\\d+'``).
* ``number``: ``-?[0-9]+(.[0-9]+)?`` (no exponents).  ``true``/``false`` are boolean literals.
* ``!`` binds tightest, so it negates a bare field or a parenthesised group; negating a
  comparison needs parentheses: ``!(platform == 'ios')``.  Comparisons do not chain.
* A bare field is a condition: true when present, not null and not empty/false/0.

Semantics (``spec/decisions.md``):

* ``==``/``!=`` compare as strings, case-sensitively.  Numbers render without ``.0`` when integral
  (``ram_mb == 8192`` and ``ram_mb == '8192'`` both hold for 8192 or 8192.0); a decimal literal
  renders in its shortest form (``1.50`` is ``1.5``: quote version strings); booleans render as
  ``true``/``false``.
* ``<``, ``<=``, ``>``, ``>=`` compare as numbers.  A string reads as a number only when it is
  spelled like a number literal (at most 64 characters); a side that is not a finite number (a
  boolean, text, NaN) makes the comparison false.
* ``~`` is a case-insensitive regular-expression *search* of the right-hand pattern (which must be
  a string literal) in the first 256 characters of the left-hand value.
* Lists (``pools``, ``capabilities``) read as comma-joined strings: ``capabilities ~ 'benchmark'``,
  ``pools ~ '(^|,)lab(,|$)'``.  ``capabilities`` of None (no opinion) reads as missing.
* **A missing or null field makes every comparison false, ``!=`` included**: an omitted field
  cannot be selected on.  ``gpu != 'mali'`` does not select a device without ``gpu``; write
  ``!(gpu == 'mali')`` to include it.  Objects (dicts) read as missing.

Limits, each refused with a :class:`MatchError` naming the position (counted from 1):
expressions over 1000 characters, nesting (parentheses and ``!``) deeper than 32, more than 256
nodes.  Patterns are checked so that one evaluation stays short (the event loop must not stall):

* no backreferences, no conditional groups, at most 256 characters;
* a repeat (max > 1) may not contain another repeat, an optional part or an alternation
  (``(a+)+``, ``(a|b)+``, ``(a?b)*``): nested or ambiguous repetition takes exponential time;
* at most 3 open-ended repeats (max over 10) and no counted repeat over 100;
* a worst-case estimate of backtracking steps on a 256-character value, summed over the
  patterns of one expression, stays within 250,000.  The three rules above are not enough on
  their own: ``.*.*.*x`` or ``(a|a)(a|a)...`` sixteen times can each take around a second.
  Anchoring a pattern with ``^`` and dropping repeats or alternatives lowers the estimate; a
  repeat that ends the pattern costs nothing.
"""

from __future__ import annotations

import functools
import importlib
import math
import operator
import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_BACKTRACK_STEPS",
    "MAX_EXPRESSION_CHARS",
    "MAX_NESTING",
    "MAX_NODES",
    "MAX_PATTERN_CHARS",
    "MAX_SEARCH_CHARS",
    "MatchError",
    "Matcher",
    "compile_match",
    "compiled",
]

MAX_EXPRESSION_CHARS = 1000
MAX_NESTING = 32
MAX_NODES = 256
MAX_PATTERN_CHARS = 256
MAX_SEARCH_CHARS = 256
MAX_WIDE_REPEATS = 3
WIDE_REPEAT = 10  # a repeat whose max exceeds this is "open-ended"
MAX_REPEAT_COUNT = 100
MAX_BACKTRACK_STEPS = 250_000
MAX_NUMBER_CHARS = 64


class MatchError(ValueError):
    """A match expression that cannot be used; ``position`` counts characters from 1."""

    def __init__(self, message: str, position: int | None = None) -> None:
        super().__init__(message)
        self.position = position


# --------------------------------------------------------------------------- values


_NUMBER_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _number_text(value: int | float) -> str | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        return str(value) if isinstance(value, int) else repr(value)
    except ValueError:  # an int too long for str(); it cannot equal anything we can spell
        return None


def _scalar_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _number_text(value)
    return None


def _text(value: Any) -> str | None:
    """The string a value compares as, or None when it reads as missing."""
    if isinstance(value, list | tuple):
        parts = (_scalar_text(item) for item in value)
        return ",".join(part for part in parts if part is not None)
    return _scalar_text(value)


def _parse_number(text: str) -> int | float | None:
    if len(text) > MAX_NUMBER_CHARS or not _NUMBER_RE.fullmatch(text):
        return None
    return float(text) if "." in text else int(text)


def _number(value: Any) -> int | float | None:
    """The number a value orders as, or None when it is not a finite number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return _parse_number(value)
    return None


def _truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    if isinstance(value, str | list | tuple):
        return len(value) > 0
    return False


# --------------------------------------------------------------------------- tree


class _Operand(ABC):
    @abstractmethod
    def get(self, view: Mapping[str, Any]) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Field(_Operand):
    name: str

    def get(self, view: Mapping[str, Any]) -> Any:
        return view.get(self.name)


@dataclass(frozen=True, slots=True)
class _Literal(_Operand):
    value: Any

    def get(self, view: Mapping[str, Any]) -> Any:
        return self.value


class _Node(ABC):
    @abstractmethod
    def evaluate(self, view: Mapping[str, Any]) -> bool: ...


@dataclass(frozen=True, slots=True)
class _Any(_Node):
    children: tuple[_Node, ...]

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        return any(child.evaluate(view) for child in self.children)


@dataclass(frozen=True, slots=True)
class _All(_Node):
    children: tuple[_Node, ...]

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        return all(child.evaluate(view) for child in self.children)


@dataclass(frozen=True, slots=True)
class _Not(_Node):
    child: _Node

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        return not self.child.evaluate(view)


@dataclass(frozen=True, slots=True)
class _Truthy(_Node):
    operand: _Operand

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        return _truthy(self.operand.get(view))


_EQUALITY: dict[str, Callable[[str, str], bool]] = {"==": operator.eq, "!=": operator.ne}
_ORDERING: dict[str, Callable[[Any, Any], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


@dataclass(frozen=True, slots=True)
class _Equality(_Node):
    left: _Operand
    op: Callable[[str, str], bool]
    right: _Operand

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        left, right = _text(self.left.get(view)), _text(self.right.get(view))
        return left is not None and right is not None and self.op(left, right)


@dataclass(frozen=True, slots=True)
class _Ordering(_Node):
    left: _Operand
    op: Callable[[Any, Any], bool]
    right: _Operand

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        left, right = _number(self.left.get(view)), _number(self.right.get(view))
        return left is not None and right is not None and self.op(left, right)


@dataclass(frozen=True, slots=True)
class _Search(_Node):
    left: _Operand
    pattern: re.Pattern[str]

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        text = _text(self.left.get(view))
        return text is not None and self.pattern.search(text[:MAX_SEARCH_CHARS]) is not None


class Matcher:
    """A parsed match expression; immutable, shared between callers through :func:`compiled`."""

    __slots__ = ("_root", "fields", "text")

    def __init__(self, text: str, root: _Node, fields: frozenset[str]) -> None:
        self.text = text
        self.fields = fields
        self._root = root

    def evaluate(self, view: Mapping[str, Any]) -> bool:
        """Whether the device described by ``view`` is selected; never raises for data."""
        return self._root.evaluate(view)

    def __repr__(self) -> str:
        return f"Matcher({self.text!r})"


# --------------------------------------------------------------------------- tokens


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # "op", "field", "string", "number", "bool", "end"
    text: str  # as written (operator symbol, field name, literal source)
    value: Any
    pos: int  # offset from 0


_SYMBOLS = ("==", "!=", "<=", ">=", "&&", "||", "<", ">", "~", "!", "(", ")")
_LONE = {"=": "==", "&": "&&", "|": "||"}
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_WORD_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.")
_ESCAPES = frozenset("\\'\"")


def _at(pos: int) -> str:
    return f"position {pos + 1}"


def _read_string(text: str, start: int) -> tuple[str, int]:
    quote, out, i = text[start], [], start + 1
    while i < len(text):
        char = text[i]
        if char == "\\" and i + 1 < len(text):
            following = text[i + 1]
            out.append(following if following in _ESCAPES else char + following)
            i += 2
        elif char == quote:
            return "".join(out), i + 1
        else:
            out.append(char)
            i += 1
    raise MatchError(f"the string starting at {_at(start)} is not closed", start + 1)


def _read_number(text: str, start: int) -> tuple[_Token, int]:
    found = _NUMBER_RE.match(text, start)
    if found is None:
        raise MatchError(f"'-' at {_at(start)} must begin a number", start + 1)
    end = found.end()
    if end < len(text) and text[end] in _WORD_CHARS:
        stop = end
        while stop < len(text) and text[stop] in _WORD_CHARS:
            stop += 1
        raise MatchError(f"malformed number '{text[start:stop]}' at {_at(start)}", start + 1)
    source = found.group()
    if "." not in source:
        return _Token("number", source, int(source), start), end
    value = float(source)
    if not math.isfinite(value):
        raise MatchError(f"the number at {_at(start)} is too large", start + 1)
    return _Token("number", source, value, start), end


def _read_word(text: str, start: int) -> tuple[_Token, int]:
    found = _IDENT_RE.match(text, start)
    assert found is not None  # called only on a letter or underscore
    word = found.group()
    if word in ("true", "false"):
        return _Token("bool", word, word == "true", start), found.end()
    return _Token("field", word, word, start), found.end()


def _read_symbol(text: str, start: int) -> tuple[_Token, int]:
    for symbol in _SYMBOLS:
        if text.startswith(symbol, start):
            return _Token("op", symbol, symbol, start), start + len(symbol)
    char = text[start]
    if char in _LONE:
        raise MatchError(
            f"'{char}' at {_at(start)} is not an operator; use '{_LONE[char]}'", start + 1
        )
    raise MatchError(f"unexpected character {char!r} at {_at(start)}", start + 1)


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in " \t\r\n":
            i += 1
            continue
        if char in "'\"":
            value, end = _read_string(text, i)
            token = _Token("string", text[i:end], value, i)
        elif char == "-" or "0" <= char <= "9":
            token, end = _read_number(text, i)
        elif char.isascii() and (char.isalpha() or char == "_"):
            token, end = _read_word(text, i)
        else:
            token, end = _read_symbol(text, i)
        tokens.append(token)
        i = end
    tokens.append(_Token("end", "", None, len(text)))
    return tokens


# --------------------------------------------------------------------------- parser

_COMPARISONS = frozenset(("==", "!=", "<", "<=", ">", ">=", "~"))


def _describe(token: _Token) -> str:
    if token.kind == "end":
        return f"the end of the expression ({_at(token.pos)})"
    return f"{token.text!r} at {_at(token.pos)}"


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.index = 0
        self.depth = 0
        self.nodes = 0
        self.steps = 0
        self.fields: set[str] = set()

    @property
    def token(self) -> _Token:
        return self.tokens[self.index]

    def is_op(self, *symbols: str) -> bool:
        return self.token.kind == "op" and self.token.text in symbols

    def advance(self) -> _Token:
        token = self.token
        self.index += 1
        return token

    def fail(self, message: str, token: _Token | None = None) -> MatchError:
        return MatchError(message, (token or self.token).pos + 1)

    def count(self, token: _Token) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(
                f"match expression has more than {MAX_NODES} parts (at {_at(token.pos)})", token
            )

    def enter(self, token: _Token) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.fail(
                f"match expression nests deeper than {MAX_NESTING} levels at {_at(token.pos)}",
                token,
            )

    def parse(self) -> _Node:
        if self.token.kind == "end":
            raise MatchError("match expression is empty", 1)
        root = self.expression()
        if self.token.kind != "end":
            raise self.fail(f"unexpected {_describe(self.token)}; expected '&&', '||' or the end")
        if self.steps > MAX_BACKTRACK_STEPS:
            raise MatchError(
                f"the patterns of this match expression could together take about {self.steps:,}"
                f" steps (limit {MAX_BACKTRACK_STEPS:,}); use fewer or simpler patterns"
            )
        return root

    def expression(self) -> _Node:
        return self.chain("||", self.conjunction, _Any)

    def conjunction(self) -> _Node:
        return self.chain("&&", self.unary, _All)

    def chain(self, symbol: str, part: Callable[[], _Node], node: Callable[..., _Node]) -> _Node:
        children = [part()]
        while self.is_op(symbol):
            self.count(self.advance())
            children.append(part())
        return children[0] if len(children) == 1 else node(tuple(children))

    def unary(self) -> _Node:
        if self.is_op("!"):
            bang = self.advance()
            self.count(bang)
            self.enter(bang)
            child = self.negated(bang)
            self.depth -= 1
            return _Not(child)
        if self.is_op("("):
            return self.group()
        return self.comparison()

    def negated(self, bang: _Token) -> _Node:
        """What '!' applies to: it binds tighter than comparisons, so never a comparison."""
        if self.is_op("!", "("):
            return self.unary()
        token, operand = self.operand()
        if self.is_op(*_COMPARISONS):
            raise self.fail(
                f"'!' at {_at(bang.pos)} applies only to {_describe(token)}, not to the "
                f"comparison {_describe(self.token)}; write !(a == b) to negate a comparison"
            )
        return self.condition(token, operand)

    def condition(self, token: _Token, operand: _Operand) -> _Node:
        if token.kind in ("string", "number"):
            raise self.fail(
                f"{_describe(token)} is not a condition on its own; compare it with a field",
                token,
            )
        return _Truthy(operand)

    def group(self) -> _Node:
        opening = self.advance()
        self.enter(opening)
        inner = self.expression()
        if not self.is_op(")"):
            raise self.fail(
                f"expected ')' to close '(' at {_at(opening.pos)}, found {_describe(self.token)}"
            )
        self.advance()
        self.depth -= 1
        if self.is_op(*_COMPARISONS):
            raise self.fail(
                f"{_describe(self.token)} cannot compare a parenthesised group; "
                "compare a field, string or number"
            )
        return inner

    def operand(self, after: str | None = None) -> tuple[_Token, _Operand]:
        token = self.token
        if token.kind == "field":
            self.fields.add(token.value)
            operand: _Operand = _Field(token.value)
        elif token.kind in ("string", "number", "bool"):
            operand = _Literal(token.value)
        else:
            where = f" after '{after}'" if after else ""
            raise self.fail(
                f"expected a field, string or number{where}, found {_describe(token)}"
            )
        self.count(token)
        self.advance()
        return token, operand

    def comparison(self) -> _Node:
        first, left = self.operand()
        if not self.is_op(*_COMPARISONS):
            return self.condition(first, left)
        symbol = self.advance()
        self.count(symbol)
        node = self.compare(left, symbol)
        if self.is_op(*_COMPARISONS):
            raise self.fail(
                f"comparisons do not chain ({_describe(self.token)}); join them with '&&'"
            )
        return node

    def compare(self, left: _Operand, symbol: _Token) -> _Node:
        token, right = self.operand(after=symbol.text)
        if symbol.text == "~":
            if token.kind != "string":
                raise self.fail(
                    f"the right side of '~' at {_at(symbol.pos)} must be a quoted pattern, "
                    f"not {_describe(token)}",
                    token,
                )
            pattern, steps = _compile_pattern(token.value, token.pos)
            self.steps += steps
            return _Search(left, pattern)
        if symbol.text in _EQUALITY:
            return _Equality(left, _EQUALITY[symbol.text], right)
        return _Ordering(left, _ORDERING[symbol.text], right)


# --------------------------------------------------------------------------- patterns

try:
    _sre: Any = importlib.import_module("re._parser")
except ImportError:  # pragma: no cover - Python before 3.11
    _sre = importlib.import_module("sre_parse")

_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT}
_POSSESSIVE = getattr(_sre, "POSSESSIVE_REPEAT", None)
_ATOMIC = getattr(_sre, "ATOMIC_GROUP", None)
_FLAGS = re.IGNORECASE

# A polynomial in the value's length L, as {degree: coefficient}: each open-ended repeat may
# stop at any of about L places, each alternative or bounded repeat multiplies the ways.
_Poly = dict[int, int]
_ONE: _Poly = {0: 1}


def _poly_mul(a: _Poly, b: _Poly) -> _Poly:
    out: _Poly = {}
    for da, ca in a.items():
        for db, cb in b.items():
            out[da + db] = out.get(da + db, 0) + ca * cb
    return out


def _poly_add(a: _Poly, b: _Poly) -> _Poly:
    out = dict(a)
    for degree, coefficient in b.items():
        out[degree] = out.get(degree, 0) + coefficient
    return out


def _steps(poly: _Poly, anchored: bool) -> int:
    """Worst-case attempts on a MAX_SEARCH_CHARS value, counting search start positions.

    d open-ended repeats (plus the start position when unanchored) choose ordered stopping
    places among L characters: C(L + d, d) ways, not L**d.
    """
    extra = 0 if anchored else 1
    return sum(
        coefficient * math.comb(MAX_SEARCH_CHARS + degree + extra, degree + extra)
        for degree, coefficient in poly.items()
    )


class _PatternCheck:
    """Walks re's parse tree of one pattern, refusing constructs that can backtrack for long."""

    def __init__(self, pattern: str, pos: int) -> None:
        self.pattern = pattern
        self.pos = pos
        self.wide = 0

    def refuse(self, reason: str) -> MatchError:
        shown = self.pattern if len(self.pattern) <= 60 else self.pattern[:57] + "..."
        return MatchError(f"match pattern {shown!r} at {_at(self.pos)} {reason}", self.pos + 1)

    def sequence(self, items: Any, in_repeat: bool) -> _Poly:
        poly = _ONE
        for op, av in items:
            poly = _poly_mul(poly, self.item(op, av, in_repeat))
        return poly

    def top(self, items: Any) -> _Poly:
        poly = _ONE
        for index, (op, av) in enumerate(items):
            if index == len(items) - 1 and op in _REPEATS:
                # a trailing greedy or lazy repeat succeeds on its first try: only its body
                # can backtrack
                factor = self.repeat(op, av, False, trailing=True)
            else:
                factor = self.item(op, av, False)
            poly = _poly_mul(poly, factor)
        return poly

    def item(self, op: Any, av: Any, in_repeat: bool) -> _Poly:
        if op is _sre.GROUPREF:
            raise self.refuse("uses a backreference, which is not allowed; remove it")
        if op is _sre.GROUPREF_EXISTS:
            raise self.refuse("uses a conditional group, which is not allowed; remove it")
        if op is _sre.SUBPATTERN:
            return self.sequence(av[3], in_repeat)
        if op is _ATOMIC:
            return self.sequence(av, in_repeat)
        if op in (_sre.ASSERT, _sre.ASSERT_NOT):
            return self.sequence(av[1], in_repeat)
        if op is _sre.BRANCH:
            if in_repeat:
                raise self.refuse(_REPEATED_ALTERNATION)
            total: _Poly = {}
            for branch in av[1]:
                total = _poly_add(total, self.sequence(branch, in_repeat))
            return total
        if op in _REPEATS or op is _POSSESSIVE:
            return self.repeat(op, av, in_repeat)
        return _ONE

    def repeat(self, op: Any, av: Any, in_repeat: bool, trailing: bool = False) -> _Poly:
        low, high, body = av
        unbounded = high == _sre.MAXREPEAT
        if low > MAX_REPEAT_COUNT or (not unbounded and high > MAX_REPEAT_COUNT):
            raise self.refuse(
                f"repeats something more than {MAX_REPEAT_COUNT} times; use a smaller count"
            )
        if in_repeat and (high > 1 or low != high):
            raise self.refuse("nests repetition, which can take exponential time; simplify it")
        if high > WIDE_REPEAT:
            self.wide += 1
        inner = self.sequence(body, in_repeat or high > 1)
        if trailing or op is _POSSESSIVE:
            return inner  # never gives back, so adds no choices of its own
        ways: _Poly = {1: 1} if high > WIDE_REPEAT else {0: high - low + 1}
        return _poly_mul(ways, inner)


_REPEATED_ALTERNATION = (
    "repeats an alternation, which can take exponential time; "
    "use a character class or simplify it"
)
_QUANTIFIER_RE = re.compile(r"\{([0-9]*)(,([0-9]*))?\}")


def _quantifier_max(pattern: str, i: int) -> int:
    """The max count of a quantifier starting at pattern[i] (0 when there is none)."""
    if i >= len(pattern):
        return 0
    if pattern[i] in "*+":
        return MAX_REPEAT_COUNT + 1
    if pattern[i] == "?":
        return 1
    found = _QUANTIFIER_RE.match(pattern, i)
    if found is None or (not found.group(1) and not found.group(2)):
        return 0
    if found.group(2) is None:
        return int(found.group(1))
    return int(found.group(3)) if found.group(3) else MAX_REPEAT_COUNT + 1


def _skip_class(pattern: str, i: int) -> int:
    """The index just after the character class opening at pattern[i]."""
    i += 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _repeats_alternation(pattern: str) -> bool:
    """Whether a repeated group contains '|' in the source.

    re's parser turns ``(a|b)+`` into a character class, so the tree alone cannot see it.
    """
    open_groups: list[bool] = []  # per open group: does it contain '|'
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if char == "[":
            i = _skip_class(pattern, i)
            continue
        i += 1
        if char == "(":
            open_groups.append(False)
        elif char == "|" and open_groups:
            open_groups[-1] = True
        elif char == ")" and open_groups:
            has_alternation = open_groups.pop()
            if has_alternation and _quantifier_max(pattern, i) > 1:
                return True
            if has_alternation and open_groups:
                open_groups[-1] = True
    return False


def _anchored(parsed: Any) -> bool:
    if not len(parsed) or parsed[0][0] is not _sre.AT:
        return False
    where = parsed[0][1]
    multiline = bool(parsed.state.flags & re.MULTILINE)
    return where is _sre.AT_BEGINNING_STRING or (where is _sre.AT_BEGINNING and not multiline)


def _parse_pattern(pattern: str, check: _PatternCheck) -> Any:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise check.refuse(f"is longer than {MAX_PATTERN_CHARS} characters; shorten it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _sre.parse(pattern, _FLAGS)
    except re.error as error:
        raise check.refuse(f"is not a valid regular expression: {error.msg}") from None
    except (OverflowError, RecursionError, ValueError) as error:
        raise check.refuse(f"is not a valid regular expression: {error}") from None


def _compile_pattern(pattern: str, pos: int) -> tuple[re.Pattern[str], int]:
    """Compile the string literal at offset ``pos``; returns it with its step estimate."""
    check = _PatternCheck(pattern, pos)
    parsed = _parse_pattern(pattern, check)
    poly = check.top(parsed)
    if _repeats_alternation(pattern):
        raise check.refuse(_REPEATED_ALTERNATION)
    if check.wide > MAX_WIDE_REPEATS:
        raise check.refuse(
            f"has more than {MAX_WIDE_REPEATS} open-ended repeats (*, + or counts over "
            f"{WIDE_REPEAT}), which can take polynomial time; simplify it"
        )
    steps = _steps(poly, _anchored(parsed))
    if steps > MAX_BACKTRACK_STEPS:
        raise check.refuse(
            f"could take about {steps:,} steps on a {MAX_SEARCH_CHARS}-character value (limit "
            f"{MAX_BACKTRACK_STEPS:,}); anchor it with ^ or use fewer repeats and alternatives"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return re.compile(pattern, _FLAGS), steps
    except (re.error, OverflowError, RecursionError, ValueError) as error:
        raise check.refuse(f"is not a valid regular expression: {error}") from None


# --------------------------------------------------------------------------- API


def compile_match(text: str) -> Matcher:
    """Parse ``text`` once; raises MatchError with a sentence naming the position."""
    if not isinstance(text, str):
        raise MatchError("match expression must be a string")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise MatchError(
            f"match expression is {len(text)} characters long; the limit is "
            f"{MAX_EXPRESSION_CHARS}",
            MAX_EXPRESSION_CHARS + 1,
        )
    parser = _Parser(text)
    root = parser.parse()
    return Matcher(text, root, frozenset(parser.fields))


@functools.lru_cache(maxsize=1024)
def compiled(text: str) -> Matcher:
    """compile_match with a cache: the same expression is evaluated for many devices."""
    return compile_match(text)
