"""Enums are compared as enums: a mode or kind written as its string in a comparison hides a typo or a renamed
member from every check (AReaL's recover module compared its modes as strings in three places)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("supervisor", "workers")
# the fault points' actions ("stop", "hang", ...) are a test instrumentation's own strings, not enum members
EXEMPT = ("supervisor/testing/",)


def our_enum_values() -> set[str]:
    """The string value of every enum member defined in our packages (`NAME = "value"` in an Enum class)."""
    values = set()
    for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and any(ast.unparse(b).endswith("Enum") for b in cls.bases):
                values |= {a.value.value for a in cls.body if isinstance(a, ast.Assign) and
                           isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)}
    return values


def string_comparisons(values: set[str]) -> list[str]:
    """`x.value == "..."`, or a literal that is one of our enums' values compared with anything."""
    found = []
    for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith(EXEMPT):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or not all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                            for op in node.ops):
                continue
            sides = [node.left, *node.comparators]
            literals = [c.value for s in sides for c in ([s] if isinstance(s, ast.Constant) else
                        s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [])
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            by_value = any(isinstance(s, ast.Attribute) and s.attr == "value" for s in sides)
            if literals and (by_value or set(literals) & values):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_enum_is_compared_as_its_string():
    values = our_enum_values()
    assert {"deepspeed", "stop", "storage_error", "bpe", "failure"} <= values  # Backend, SaveErrorAction, ...
    assert string_comparisons(values) == []
