"""A small subset of CEL, enough for the ``x-kubernetes-validations`` rules of test CRDs.

Supported: literals (int, uint, double, string, bool, null, lists, maps), ``self`` and
``oldSelf``, field access and indexing, ``has()``, the operators ``! - * / % + - < <= > >= ==
!= in && || ?:``, ``size()``, string ``startsWith/endsWith/contains/matches/lowerAscii/
upperAscii``, ``int()/uint()/double()/string()``, and the macros ``all/exists/exists_one/map/
filter``. A rule outside this subset fails to compile, so a CRD using it is rejected at
create time rather than silently unchecked. ``&&`` and ``||`` absorb errors as CEL does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class CelSyntaxError(Exception):
    """The rule is not (a supported subset of) CEL."""


class CelEvalError(Exception):
    """The rule failed at run time (e.g. ``no such key``)."""


_TOKEN = re.compile(
    r"""\s*(?:
      (?P<num>\d+\.\d*(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|0x[0-9a-fA-F]+u?|\d+u?)
    | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op>&&|\|\||==|!=|<=|>=|[-+*/%<>!?:.,()\[\]{}])
    )""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Token:
    kind: str  # num, str, ident, op, end
    text: str


def _tokenize(source: str) -> list[Token]:
    tokens: list[Token] = []
    pos = 0
    while pos < len(source):
        if source[pos:].strip() == "":
            break
        match = _TOKEN.match(source, pos)
        if not match or match.end() == pos:
            raise CelSyntaxError(f"unexpected character at {pos}: {source[pos : pos + 10]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append(Token(kind, match.group(kind)))
        pos = match.end()
    tokens.append(Token("end", ""))
    return tokens


# AST nodes are tuples: (tag, ...). Kept as tuples for brevity; see Parser for the shapes.
Node = tuple[Any, ...]

_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_FUNCTIONS = {"size", "int", "uint", "double", "string", "bool", "has"}
_METHODS = {
    "size",
    "startsWith",
    "endsWith",
    "contains",
    "matches",
    "lowerAscii",
    "upperAscii",
}


class Parser:
    def __init__(self, source: str) -> None:
        self.tokens = _tokenize(source)
        self.pos = 0

    def peek(self) -> Token:
        return self.tokens[self.pos]

    def take(self, text: str | None = None) -> Token:
        token = self.tokens[self.pos]
        if text is not None and token.text != text:
            raise CelSyntaxError(f"expected {text!r}, found {token.text or 'end of rule'!r}")
        self.pos += 1
        return token

    def accept(self, text: str) -> bool:
        if self.peek().kind == "op" and self.peek().text == text:
            self.pos += 1
            return True
        return False

    def parse(self) -> Node:
        node = self.expr()
        if self.peek().kind != "end":
            raise CelSyntaxError(f"unexpected {self.peek().text!r}")
        return node

    def expr(self) -> Node:
        cond = self.binary(0)
        if self.accept("?"):
            then = self.binary(0)
            self.take(":")
            return ("cond", cond, then, self.expr())
        return cond

    _LEVELS: tuple[tuple[str, ...], ...] = (
        ("||",),
        ("&&",),
        ("<", "<=", ">", ">=", "==", "!=", "in"),
        ("+", "-"),
        ("*", "/", "%"),
    )

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        node = self.binary(level + 1)
        while True:
            token = self.peek()
            if token.kind in ("op", "ident") and token.text in self._LEVELS[level]:
                self.pos += 1
                node = (token.text, node, self.binary(level + 1))
            else:
                return node

    def unary(self) -> Node:
        if self.accept("!"):
            return ("!", self.unary())
        if self.accept("-"):
            return ("neg", self.unary())
        return self.member()

    def member(self) -> Node:
        node = self.primary()
        while True:
            if self.accept("."):
                name = self.take().text
                if self.accept("("):
                    args = self.args(")")
                    if name in _MACROS:
                        if len(args) != 2 or args[0][0] != "ident":
                            raise CelSyntaxError(f"{name}() takes a variable and an expression")
                        node = ("macro", name, node, args[0][1], args[1])
                    elif name in _METHODS:
                        node = ("call", name, [node, *args])
                    else:
                        raise CelSyntaxError(f"function {name!r} is not in the emulator's CEL")
                else:
                    node = ("field", node, name)
            elif self.accept("["):
                index = self.expr()
                self.take("]")
                node = ("index", node, index)
            else:
                return node

    def args(self, close: str) -> list[Node]:
        items: list[Node] = []
        if self.accept(close):
            return items
        while True:
            items.append(self.expr())
            if self.accept(close):
                return items
            self.take(",")

    def primary(self) -> Node:
        token = self.take()
        if token.kind == "num":
            return ("lit", _number(token.text))
        if token.kind == "str":
            return ("lit", _string(token.text))
        if token.kind == "ident":
            if token.text in ("true", "false"):
                return ("lit", token.text == "true")
            if token.text == "null":
                return ("lit", None)
            if self.accept("("):
                args = self.args(")")
                if token.text == "has":
                    if len(args) != 1 or args[0][0] != "field":
                        raise CelSyntaxError("has() takes a field selection, e.g. has(self.x)")
                    return ("has", args[0][1], args[0][2])
                if token.text not in _FUNCTIONS:
                    raise CelSyntaxError(f"function {token.text!r} is not in the emulator's CEL")
                return ("call", token.text, args)
            return ("ident", token.text)
        if token.text == "(":
            node = self.expr()
            self.take(")")
            return node
        if token.text == "[":
            return ("list", self.args("]"))
        if token.text == "{":
            entries: list[tuple[Node, Node]] = []
            if not self.accept("}"):
                while True:
                    key = self.expr()
                    self.take(":")
                    entries.append((key, self.expr()))
                    if self.accept("}"):
                        break
                    self.take(",")
            return ("map", entries)
        raise CelSyntaxError(f"unexpected {token.text or 'end of rule'!r}")


def _number(text: str) -> int | float:
    if text.endswith("u"):
        text = text[:-1]
    if text.startswith("0x"):
        return int(text, 16)
    if any(c in text for c in ".eE"):
        return float(text)
    return int(text)


def _string(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "r": "\r"}.get(m[1], m[1]), body)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    return "null_type"


def _equal(a: Any, b: Any) -> bool:
    if _is_num(a) and _is_num(b):
        return bool(a == b)
    if type(a) is not type(b):
        return False
    return bool(a == b)


def _compare(op: str, a: Any, b: Any) -> bool:
    if not ((_is_num(a) and _is_num(b)) or (type(a) is type(b) and isinstance(a, (str, bool)))):
        raise CelEvalError(f"no such overload: {_type_name(a)} {op} {_type_name(b)}")
    return bool({"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op])


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "+" and type(a) is type(b) and isinstance(a, (str, list)):
        return a + b
    if not (_is_num(a) and _is_num(b)):
        raise CelEvalError(f"no such overload: {_type_name(a)} {op} {_type_name(b)}")
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise CelEvalError("division by zero" if op == "/" else "modulus by zero")
    if isinstance(a, int) and isinstance(b, int):
        quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
        return quotient if op == "/" else a - b * quotient
    return a / b if op == "/" else a % b


def _size(value: Any) -> int:
    if isinstance(value, (str, list, dict)):
        return len(value)
    raise CelEvalError(f"no such overload: size({_type_name(value)})")


def _call(name: str, args: list[Any]) -> Any:
    if name == "size" and len(args) == 1:
        return _size(args[0])
    if name == "int" and len(args) == 1:
        try:
            return int(args[0])
        except (TypeError, ValueError) as exc:
            raise CelEvalError(f"cannot convert {args[0]!r} to int") from exc
    if name == "uint" and len(args) == 1:
        return abs(int(args[0]))
    if name == "double" and len(args) == 1:
        return float(args[0])
    if name == "string" and len(args) == 1:
        value = args[0]
        return ("true" if value else "false") if isinstance(value, bool) else str(value)
    if name == "bool" and len(args) == 1:
        return args[0] in (True, "true")
    if len(args) >= 1 and isinstance(args[0], str):
        text, rest = args[0], args[1:]
        string_methods: dict[str, Callable[..., Any]] = {
            "startsWith": text.startswith,
            "endsWith": text.endswith,
            "contains": lambda s: s in text,
            "matches": lambda pattern: re.search(pattern, text) is not None,
            "lowerAscii": text.lower,
            "upperAscii": text.upper,
        }
        if name in string_methods:
            return string_methods[name](*rest)
    raise CelEvalError(f"no such overload: {name}({', '.join(_type_name(a) for a in args)})")


class Program:
    """A compiled rule; ``evaluate(self_value, old_self)`` returns the result."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.ast = Parser(source).parse()
        self.uses_old_self = "oldSelf" in re.findall(r"[A-Za-z_]\w*", source)

    def evaluate(self, self_value: Any, old_self: Any = None) -> Any:
        return _eval(self.ast, {"self": self_value, "oldSelf": old_self})


def compile_rule(source: str) -> Program:
    return Program(source)


def _eval(node: Node, env: dict[str, Any]) -> Any:
    tag = node[0]
    if tag == "lit":
        return node[1]
    if tag == "ident":
        if node[1] not in env:
            raise CelEvalError(f"undeclared reference to {node[1]!r}")
        return env[node[1]]
    if tag == "list":
        return [_eval(n, env) for n in node[1]]
    if tag == "map":
        return {_eval(k, env): _eval(v, env) for k, v in node[1]}
    if tag == "field":
        target = _eval(node[1], env)
        if not isinstance(target, dict):
            raise CelEvalError(f"no such key: {node[2]}")
        if node[2] not in target:
            raise CelEvalError(f"no such key: {node[2]}")
        return target[node[2]]
    if tag == "has":
        target = _eval(node[1], env)
        return isinstance(target, dict) and node[2] in target
    if tag == "index":
        target, index = _eval(node[1], env), _eval(node[2], env)
        if isinstance(target, list) and isinstance(index, int) and 0 <= index < len(target):
            return target[index]
        if isinstance(target, dict) and index in target:
            return target[index]
        raise CelEvalError(f"index out of bounds or no such key: {index!r}")
    if tag == "cond":
        condition = _eval(node[1], env)
        if not isinstance(condition, bool):
            raise CelEvalError("no matching overload for '_?_:_'")
        return _eval(node[2] if condition else node[3], env)
    if tag == "!":
        value = _eval(node[1], env)
        if not isinstance(value, bool):
            raise CelEvalError(f"no such overload: !{_type_name(value)}")
        return not value
    if tag == "neg":
        value = _eval(node[1], env)
        if not _is_num(value):
            raise CelEvalError(f"no such overload: -{_type_name(value)}")
        return -value
    if tag in ("&&", "||"):
        return _logic(tag, node, env)
    if tag == "call":
        return _call(node[1], [_eval(a, env) for a in node[2]])
    if tag == "macro":
        return _macro(node, env)
    left, right = _eval(node[1], env), _eval(node[2], env)
    if tag == "==":
        return _equal(left, right)
    if tag == "!=":
        return not _equal(left, right)
    if tag in ("<", "<=", ">", ">="):
        return _compare(tag, left, right)
    if tag == "in":
        if isinstance(right, list):
            return any(_equal(left, item) for item in right)
        if isinstance(right, dict):
            return left in right
        raise CelEvalError(f"no such overload: {_type_name(left)} in {_type_name(right)}")
    return _arith(tag, left, right)


def _logic(tag: str, node: Node, env: dict[str, Any]) -> bool:
    short = tag == "||"  # the value that decides the result on its own
    error: CelEvalError | None = None
    for operand in (node[1], node[2]):
        try:
            value = _eval(operand, env)
        except CelEvalError as exc:
            error = error or exc
            continue
        if not isinstance(value, bool):
            error = error or CelEvalError(f"no such overload: {_type_name(value)} {tag} ...")
        elif value is short:
            return short
    if error is not None:
        raise error
    return not short


def _macro(node: Node, env: dict[str, Any]) -> Any:
    _, name, target_node, var, body = node
    target = _eval(target_node, env)
    if isinstance(target, dict):
        items = list(target.keys())
    elif isinstance(target, list):
        items = target
    else:
        raise CelEvalError(f"no such overload: {_type_name(target)}.{name}()")
    results = [(item, _eval(body, {**env, var: item})) for item in items]
    if name == "map":
        return [value for _, value in results]
    if any(not isinstance(value, bool) for _, value in results):
        raise CelEvalError(f"{name}() needs a boolean expression")
    if name == "all":
        return all(value for _, value in results)
    if name == "exists":
        return any(value for _, value in results)
    if name == "exists_one":
        return sum(1 for _, value in results if value) == 1
    return [item for item, value in results if value]  # filter
