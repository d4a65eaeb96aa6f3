"""python/refit/_refit.pyi against the extension module it describes (refit._refit).

Both ways: every public name of the module (functions, classes, their methods, properties and
static methods, and the protocol methods such as __init__, __enter__ and __len__) is in the stub,
and every name the stub declares is in the module, of the same kind; and every function's and
method's parameters — names, order, keyword-only, which have defaults and the literal defaults —
are the same as the module's signatures (pybind11 writes them on the first line of each
docstring). Types are not compared: pybind11 names them its own way.
"""

import ast
import os
import re

import pytest

from refit import _refit as ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = os.path.join(ROOT, "python", "refit", "_refit.pyi")

# Dunder methods that are part of a class's interface when the module defines them (pybind11 also
# defines __repr__, __eq__, __hash__, pickling and others, which every object has).
PROTOCOL = {"__init__", "__enter__", "__exit__", "__len__", "__iter__", "__getitem__",
            "__contains__", "__call__"}
# Module-level dunders the stub declares as attributes.
MODULE_ATTRIBUTES = {"__version__", "__wire_version__"}


def split_top(text):
    """Splits on commas that are not inside brackets or quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            cur += ch
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def literal(text):
    try:
        return ("literal", ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return ("expression", text)


def runtime_signature(obj, name, method):
    """[(name or None when pybind11 made one up, kind 'pos' | 'kw', default or None)] from the
    first line of a pybind11 function's docstring; `method`: drop `self`."""
    doc = (obj.__doc__ or "").strip()
    first = doc.splitlines()[0] if doc else ""
    m = re.match(re.escape(name) + r"\((.*)\)( -> .*)?$", first)
    assert m, f"{name}: no pybind11 signature on the first line of its docstring: {first!r}"
    assert "Overloaded function" not in doc, f"{name}: overloads are not compared"
    params, kind = [], "pos"
    for part in split_top(m.group(1)):
        if part == "*":
            kind = "kw"
            continue
        pname, _, rest = part.partition(":")
        default = None
        if "=" in rest:
            default = literal(rest.split("=", 1)[1].strip())
        pname = pname.strip()
        params.append((None if re.fullmatch(r"arg\d+", pname) else pname, kind, default))
    if method:
        assert params and params[0][0] == "self", f"{name}: {first!r}"
        params = params[1:]
    return params


def stub_signature(fn, method):
    a = fn.args
    assert not a.vararg and not a.kwarg, f"{fn.name}: *args / **kwargs in the stub"
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [(p.arg, "pos", d) for p, d in zip(positional, defaults)]
    params += [(p.arg, "kw", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    params = [(n, k, None if d is None else literal(ast.unparse(d))) for n, k, d in params]
    if method:
        assert params and params[0][0] == "self", f"{fn.name}: no self in the stub"
        params = params[1:]
    return params


def same_parameters(name, stub, runtime):
    problems = []
    if len(stub) != len(runtime):
        return [f"{name}: the stub has {len(stub)} parameter(s) {[p[0] for p in stub]}, the module "
                f"{len(runtime)} {[p[0] for p in runtime]}"]
    for (sn, sk, sd), (rn, rk, rd) in zip(stub, runtime):
        if rn is not None and sn != rn:
            problems.append(f"{name}: parameter {sn!r} in the stub is {rn!r} in the module")
        if sk != rk:
            problems.append(f"{name}: parameter {sn!r} is {'keyword-only' if rk == 'kw' else 'positional'} "
                            f"in the module, not in the stub")
        if (sd is None) != (rd is None):
            problems.append(f"{name}: parameter {sn!r} has a default in "
                            f"{'the stub' if rd is None else 'the module'} only")
        elif sd is not None and sd[0] == rd[0] == "literal" and sd[1] != rd[1]:
            problems.append(f"{name}: parameter {sn!r} defaults to {sd[1]!r} in the stub, "
                            f"{rd[1]!r} in the module")
    return problems


def parse_stub():
    with open(STUB) as f:
        tree = ast.parse(f.read(), STUB)
    functions, classes, attributes = {}, {}, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            attributes.add(node.target.id)
    return functions, classes, attributes


def stub_members(cls):
    """{name: (kind, FunctionDef or None)} with kind 'method' | 'property' | 'static'."""
    out = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            kind = ("property" if "property" in decorators
                    else "static" if "staticmethod" in decorators else "method")
            out[node.name] = (kind, node)
    return out


def runtime_members(cls):
    out = {}
    for name, raw in vars(cls).items():
        if name.startswith("_") and name not in PROTOCOL:
            continue
        if type(raw).__name__ == "wrapper_descriptor":  # pybind11's "No constructor defined!"
            continue
        if isinstance(raw, property):
            out[name] = "property"
        elif isinstance(raw, staticmethod):
            out[name] = "static"
        elif callable(raw):
            out[name] = "method"
        else:
            out[name] = "attribute"
    return out


def module_public():
    functions, classes = {}, {}
    for name in dir(ext):
        if name.startswith("_"):
            continue
        obj = getattr(ext, name)
        if isinstance(obj, type):
            classes[name] = obj
        elif callable(obj):
            functions[name] = obj
        else:
            pytest.fail(f"refit._refit.{name} is neither a class nor a function")
    return functions, classes


def test_the_stub_names_every_public_name_of_the_module_and_nothing_else():
    stub_functions, stub_classes, stub_attributes = parse_stub()
    functions, classes = module_public()
    assert sorted(stub_functions) == sorted(functions), "module-level functions"
    assert sorted(stub_classes) == sorted(classes), "classes"
    for name in MODULE_ATTRIBUTES:
        assert hasattr(ext, name), name
    assert stub_attributes == MODULE_ATTRIBUTES
    problems = []
    for cname, cls in classes.items():
        declared = stub_members(stub_classes[cname])
        defined = runtime_members(cls)
        for name, kind in defined.items():
            if name not in declared:
                problems.append(f"{cname}.{name} ({kind}) is not in the stub")
            elif declared[name][0] != kind:
                problems.append(f"{cname}.{name} is a {kind} in the module, a {declared[name][0]} "
                                "in the stub")
        for name, (kind, _) in declared.items():
            if name not in defined and not (name in PROTOCOL and hasattr(cls, name)):
                problems.append(f"{cname}.{name} ({kind}) is in the stub, not in the module")
    assert not problems, "\n".join(problems)


def test_every_signature_of_the_stub_is_the_modules():
    stub_functions, stub_classes, _ = parse_stub()
    functions, classes = module_public()
    problems = []
    for name, fn in functions.items():
        problems += same_parameters(name, stub_signature(stub_functions[name], False),
                                    runtime_signature(fn, name, False))
    checked = len(functions)
    for cname, cls in classes.items():
        for name, (kind, node) in stub_members(stub_classes[cname]).items():
            if kind == "property" or name not in vars(cls):
                continue
            raw = vars(cls)[name]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            problems += same_parameters(f"{cname}.{name}", stub_signature(node, kind == "method"),
                                        runtime_signature(fn, name, kind == "method"))
            checked += 1
    assert not problems, "\n".join(problems)
    # The comparison ran over the module's whole surface, not over nothing.
    assert checked >= 30, checked
