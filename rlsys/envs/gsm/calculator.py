"""The `calculate` tool: a safe arithmetic evaluator over Python's `ast`, never `eval`.

Grammar: numbers (int or float literals), + - * / // % **, parentheses, unary + and -. Anything else (names,
calls, attributes, subscripts, comparisons, strings, `^`, commas) is refused by the node whitelist before any
arithmetic runs. Limits keep one call cheap whatever the model writes:
    MAX_CHARS characters of expression; MAX_MAGNITUDE on every literal and intermediate result (so repeated
    multiplication cannot grow a big int); a power must have |exponent| <= MAX_EXPONENT and a result that the
    magnitude limit allows, checked with logarithms *before* it is computed (`2**10**10` never runs).
Every refusal is a `CalculatorError` whose message is what the model reads as the tool result.
"""
from __future__ import annotations

import ast
import math
import operator

MAX_CHARS = 200
MAX_MAGNITUDE = 1e15
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_HINTS = {ast.BitXor: "^ is not a power here: use **", ast.MatMult: "@ is not supported"}


class CalculatorError(ValueError):
    """The expression is refused; the message is the tool result the model sees."""


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("error: the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"error: a number above {MAX_MAGNITUDE:.0e} in magnitude")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"error: exponent {exponent} is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("error: division by zero")
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"error: a number above {MAX_MAGNITUDE:.0e} in magnitude")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("error: a fractional power of a negative number")
    return base ** exponent


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"error: {node.value!r} is not a number")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY:
            raise CalculatorError(f"error: {_HINTS.get(op, 'operator ' + op.__name__ + ' is not supported')}")
        left, right = _eval(node.left), _eval(node.right)
        if op is ast.Pow:
            return _checked(_power(left, right))
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise CalculatorError("error: division by zero")
        return _checked(_BINARY[op](left, right))
    raise CalculatorError(f"error: {type(node).__name__.lower()} is not allowed: only numbers, + - * / // % ** "
                          "and parentheses")


def evaluate(expression: object) -> int | float:
    """The value of `expression`, or CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError("error: the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"error: the expression is longer than {MAX_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("error: the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"error: cannot parse {expression.strip()!r} as arithmetic") from None
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("error: the expression is nested too deeply") from None
    except (OverflowError, ZeroDivisionError) as err:  # float ** and % corner cases the checks above let through
        raise CalculatorError(f"error: {err}") from None


def format_number(value: int | float) -> str:
    """What the model reads: an integer without '.0', a float with up to 10 significant digits."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def calculate(expression: object) -> str:
    """The tool result: the formatted value, or the error message."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        return str(err)
