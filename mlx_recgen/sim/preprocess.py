"""Turn the MSL text MLX builds into C++ the simulator can compile.

Every transformation keeps the line structure, so a compiler diagnostic's line
number is the line number in the MSL text (``#line 1 "<kernel>.metal"``):

* ``[[...]]`` attributes are blanked;
* pointer/reference types qualified with ``device``/``constant``/``threadgroup``
  become ``::msl::ptr<T>`` (a bounds- and race-checked pointer) / ``T&``;
* ``threadgroup T name[N]...;`` declarations become per-threadgroup storage
  (``::msl::tgsite``), shared by the threads of one group and fresh (garbage
  filled) for every group;
* floating literals without suffix get ``f`` (MSL has no double: they are float),
  ``1.0h`` becomes a half;
* tokens Metal rejects and C++ accepts (``double``, ``goto``, ``new``, ``std::``,
  ...) and recursive calls (best effort) raise :class:`MetalCompileError`.
"""

from __future__ import annotations

import re

from .errors import MetalCompileError

_IDENT = r"[A-Za-z_]\w*"
_TYPE = (
    r"(?:::)?[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*"
    r"(?:\s*<[^<>;{}]*(?:<[^<>;{}]*>[^<>;{}]*)*>)?"
)


def mask_code(text: str) -> str:
    """Copy of ``text`` with comments and string/char literal contents replaced by spaces
    (newlines kept), so regexes only see code."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if text[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    edits.sort()
    parts, last = [], 0
    for s, e, r in edits:
        if s < last:
            continue
        parts.append(text[last:s])
        parts.append(r)
        last = e
    parts.append(text[last:])
    return "".join(parts)


def _keep_newlines(original: str, replacement: str) -> str:
    return replacement + "\n" * original.count("\n")


# ---------------------------------------------------------------------------
# Metal-only rejections
# ---------------------------------------------------------------------------
_FORBIDDEN = {
    "double": "MSL has no `double` type (use float)",
    "goto": "MSL does not support `goto`",
    "new": "MSL does not support `new`",
    "delete": "MSL does not support `delete`",
    "throw": "MSL does not support exceptions",
    "try": "MSL does not support exceptions",
    "catch": "MSL does not support exceptions",
    "virtual": "MSL does not support virtual functions",
    "typeid": "MSL does not support run-time type information",
    "dynamic_cast": "MSL does not support dynamic_cast",
    "thread_local": "MSL does not support thread_local",
    "register": "MSL does not support `register`",
}

_KEYWORDS_NOT_CALLS = {
    "if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype", "static_cast",
    "reinterpret_cast", "const_cast", "static_assert", "catch", "defined", "__attribute__",
}


def check_metal_rules(text: str, kernel_name: str, filename: str) -> None:
    """Raise MetalCompileError for constructs MSL rejects but C++ accepts."""
    masked = mask_code(text)
    # preprocessor lines are not code, but `double` in a #define is still used later: keep them
    for m in re.finditer(r"(?<![\w$])(" + "|".join(_FORBIDDEN) + r")(?![\w$])", masked):
        tok = m.group(1)
        ln = line_of(text, m.start())
        raise MetalCompileError(
            f"kernel `{kernel_name}`: {filename}:{ln}: error: {_FORBIDDEN[tok]}\n"
            f"  {ln} | {text.splitlines()[ln - 1].strip()}",
            kernel=kernel_name, line=ln,
        )
    m = re.search(r"(?<![\w:])std\s*::", masked)
    if m:
        ln = line_of(text, m.start())
        raise MetalCompileError(
            f"kernel `{kernel_name}`: {filename}:{ln}: error: MSL has no C++ standard library "
            f"(`std::`)\n  {ln} | {text.splitlines()[ln - 1].strip()}",
            kernel=kernel_name, line=ln,
        )
    m = re.search(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[lL](?![\w.])", masked)
    if m and ("." in m.group(0) or m.group(2)):
        ln = line_of(text, m.start())
        raise MetalCompileError(
            f"kernel `{kernel_name}`: {filename}:{ln}: error: MSL has no long double literals",
            kernel=kernel_name, line=ln,
        )
    check_recursion(text, masked, kernel_name, filename)


def _function_definitions(masked: str):
    """Yield (name, body_start, body_end) for every function definition found."""
    pat = re.compile(r"(?<![\w:.>])(" + _IDENT + r")\s*\(([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*)\)"
                     r"\s*(?:const\s*)?(?:noexcept\s*)?\{")
    pos = 0
    while True:
        m = pat.search(masked, pos)
        if not m:
            return
        name = m.group(1)
        brace = m.end() - 1
        depth, j = 0, brace
        while j < len(masked):
            if masked[j] == "{":
                depth += 1
            elif masked[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        if name in _KEYWORDS_NOT_CALLS:
            pos = m.end()
            continue
        yield name, brace, j
        pos = j + 1 if j > brace else m.end()


def check_recursion(text: str, masked: str, kernel_name: str, filename: str) -> None:
    """Best effort: a call graph over the function names defined in the text; a cycle
    through names that are defined once is reported (Metal rejects recursion)."""
    defs: dict[str, list[tuple[int, int]]] = {}
    for name, s, e in _function_definitions(masked):
        defs.setdefault(name, []).append((s, e))
    single = {n for n, v in defs.items() if len(v) == 1}
    calls: dict[str, set[str]] = {}
    for n in single:
        s, e = defs[n][0]
        body = masked[s:e]
        called = set(re.findall(r"(?<![\w.])(" + _IDENT + r")\s*(?:<[^<>;{}()]*>)?\s*\(", body))
        calls[n] = {c for c in called if c in single}

    # DFS for a cycle
    color: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u: str):
        color[u] = 1
        stack.append(u)
        for v in sorted(calls.get(u, ())):
            if color.get(v) == 1:
                cyc = stack[stack.index(v):] + [v]
                return cyc
            if color.get(v) is None:
                r = dfs(v)
                if r:
                    return r
        stack.pop()
        color[u] = 2
        return None

    for n in sorted(single):
        if color.get(n) is None:
            cyc = dfs(n)
            if cyc:
                s, _ = defs[cyc[0]][0]
                ln = line_of(text, s)
                raise MetalCompileError(
                    f"kernel `{kernel_name}`: {filename}:{ln}: error: recursive call "
                    f"{' -> '.join(cyc)} (Metal does not support recursion)",
                    kernel=kernel_name, line=ln,
                )


# ---------------------------------------------------------------------------
# Rewrites for the execution pass
# ---------------------------------------------------------------------------
_ATTR = re.compile(r"\[\[(?:[^\[\]]|\[[^\[\]]*\])*\]\]")


def blank_attributes(text: str) -> str:
    masked = mask_code(text)
    edits = [(m.start(), m.end(), " " * (m.end() - m.start()))
             for m in _ATTR.finditer(masked)]
    return _apply(text, edits)


_ASPTR = re.compile(
    r"(?<![\w:])((?:(?:const|volatile)\s+)*)(device|constant|threadgroup)\s+"
    r"((?:(?:const|volatile)\s+)*)(" + _TYPE + r")\s*(\*|&)"
)


def rewrite_pointer_types(text: str) -> str:
    masked = mask_code(text)
    edits = []
    for m in _ASPTR.finditer(masked):
        cv = (m.group(1) + m.group(3)).split()
        const = "const " if "const" in cv else ""
        typ = text[m.start(4):m.end(4)]
        typ_flat = " ".join(typ.split())
        orig = text[m.start():m.end()]
        if m.group(5) == "*":
            rep = f"::msl::ptr<{const}{typ_flat}>"
        else:
            rep = f"{const}{typ_flat}&"
        edits.append((m.start(), m.end(), _keep_newlines(orig, rep)))
    text = _apply(text, edits)
    # reinterpret_cast<::msl::ptr<T>>(x) -> ::msl::ptr_cast<::msl::ptr<T>>(x)
    text = re.sub(r"reinterpret_cast(\s*<\s*::msl::ptr<)", r"::msl::ptr_cast\1", text)
    return text


_TGDECL = re.compile(
    r"(?<![\w:])threadgroup\s+(" + _TYPE + r")\s+("
    + _IDENT + r"\s*(?:\[[^\[\];]*\]\s*)*(?:,\s*" + _IDENT + r"\s*(?:\[[^\[\];]*\]\s*)*)*);"
)


def rewrite_threadgroup_decls(text: str) -> str:
    masked = mask_code(text)
    edits = []
    for m in _TGDECL.finditer(masked):
        typ = " ".join(text[m.start(1):m.end(1)].split())
        decls = text[m.start(2):m.end(2)]
        out = []
        for d in _split_top(decls):
            dm = re.match(r"\s*(" + _IDENT + r")\s*((?:\[[^\[\]]*\]\s*)*)$", d)
            if not dm:
                continue
            name = dm.group(1)
            dims = re.findall(r"\[([^\[\]]*)\]", dm.group(2))
            site = f"{name}__msl_tg"
            if dims:
                dlist = ", ".join(f"(size_t)({' '.join(x.split())})" for x in dims)
                out.append(f"static ::msl::tgsite<{typ}, {dlist}> {site}; "
                           f"auto {name} = {site}.get(\"{name}\");")
            else:
                out.append(f"static ::msl::tgsite<{typ}, 1> {site}; "
                           f"auto {name} = {site}.get_scalar(\"{name}\");")
        orig = text[m.start():m.end()]
        edits.append((m.start(), m.end(), _keep_newlines(orig, " ".join(out))))
    return _apply(text, edits)


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "[(<":
            depth += 1
        elif c in "])>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


_FLOAT_LIT = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)([fFhH])?(?![\w.])"
)


def rewrite_float_literals(text: str) -> str:
    """MSL floating literals without suffix are float; `h` makes a half."""
    masked = mask_code(text)
    edits = []
    for m in _FLOAT_LIT.finditer(masked):
        # skip preprocessor directive lines (#if __METAL_VERSION__ >= ...)
        ls = masked.rfind("\n", 0, m.start()) + 1
        if masked[ls:m.start()].lstrip().startswith("#") and not masked[ls:m.start()].lstrip().startswith("#define"):
            continue
        num, suf = m.group(1), m.group(2)
        if suf in ("f", "F"):
            continue
        if suf in ("h", "H"):
            edits.append((m.start(), m.end(), f"::msl::half_lit({num}f)"))
        else:
            edits.append((m.start(), m.end(), num + "f"))
    return _apply(text, edits)


# Words after which `name[` starts an expression, not a declaration of an array `name`.
_EXPR_WORDS = {"return", "case", "else", "do", "sizeof", "co_return", "co_yield"}
# Words that are not variables even when `[` follows.
_NOT_VARIABLES = {"operator", "auto", "new", "delete", "this", "template", "typename"}
_SUBSCRIPT = re.compile(r"(?<![\w.:~>$])(" + _IDENT + r")(\s*)\[(?!\[)")


def _starts_expression(masked: str, pos: int) -> bool:
    """Is the identifier at ``pos`` (followed by ``[``) in an expression rather than the
    name of an array being declared?  When unsure, say no: an unmarked access only loses
    its line number, a marked declaration would not compile."""
    j = _last_non_space(masked, pos - 1)
    if j < 0:
        return True
    c = masked[j]
    if c.isalnum() or c == "_":
        return _word_ending_at(masked, j) in _EXPR_WORDS
    if c == ">":
        # `vec<float, 4> a[2]` declares; `x > a[i]` compares: a `<` right after a word,
        # in the same statement, makes it a template argument list
        depth = 0
        for k in range(j, -1, -1):
            ch = masked[k]
            if ch in ";{}":
                return True
            if ch == ">":
                depth += 1
            elif ch == "<":
                depth -= 1
                if depth == 0:
                    m = k - 1
                    while m >= 0 and masked[m] in " \t":
                        m -= 1
                    return not (m >= 0 and (masked[m].isalnum() or masked[m] == "_"))
        return True
    if c == ",":
        # `T a[2], b[3];` declares b: a comma at the top level of a statement that
        # starts with `type name` separates declarators
        k, depth = j - 1, 0
        while k >= 0:
            ch = masked[k]
            if ch in ")]}":
                depth += 1
            elif ch in "([{":
                if depth == 0:
                    if ch == "{" and not _opens_braced_list(masked, k):
                        break  # a block: the statement starts after it
                    return True  # inside a call, subscript or braced list: an element
                depth -= 1
            elif ch == ";" and depth == 0:
                break
            k -= 1
        stmt = masked[k + 1:j]
        return not re.match(r"\s*(?:const\s+)?" + _TYPE + r"\s*[*&]?\s+" + _IDENT, stmt)
    return True


def _opens_braced_list(masked: str, k: int) -> bool:
    """Does the ``{`` at ``k`` open an initialiser list (``= {``, ``f({``, ``float2{``) rather
    than a block?"""
    j = _last_non_space(masked, k - 1)
    if j < 0:
        return False
    c = masked[j]
    if c.isalnum() or c == "_":
        return _word_ending_at(masked, j) not in {"else", "do", "try"}
    return c in "=(,>]"


def _last_non_space(masked: str, j: int) -> int:
    """The index of the last character at or before ``j`` that is not white space (-1: none)."""
    while j >= 0 and masked[j] in " \t\r\n":
        j -= 1
    return j


def _word_ending_at(masked: str, j: int) -> str:
    """The identifier-like word whose last character is at ``j``."""
    k = j
    while k >= 0 and (masked[k].isalnum() or masked[k] == "_"):
        k -= 1
    return masked[k + 1:j + 1]


def mark_subscript_lines(text: str) -> str:
    """``name[`` -> ``::msl::at_line(name, __LINE__)[`` where ``name[...]`` is an element
    access, so that bounds and race reports give the line of the access."""
    masked = mask_code(text)
    edits = []
    for m in _SUBSCRIPT.finditer(masked):
        name = m.group(1)
        if name in _NOT_VARIABLES or name in _FORBIDDEN or name in _KEYWORDS_NOT_CALLS:
            continue
        ls = masked.rfind("\n", 0, m.start()) + 1
        directive = masked[ls:m.start()].lstrip()
        if directive.startswith("#") and not directive.startswith("#define"):
            continue
        if not _starts_expression(masked, m.start()):
            continue
        edits.append((m.start(), m.end(1), f"::msl::at_line({name}, __LINE__)"))
    return _apply(text, edits)


def to_cpp(text: str, lines: bool = True) -> str:
    """MSL text (header + MLX signature + body) -> C++ for the shim, same lines.

    ``lines``: mark element accesses with their line (see :func:`mark_subscript_lines`)."""
    text = blank_attributes(text)
    text = rewrite_pointer_types(text)
    text = rewrite_threadgroup_decls(text)
    text = rewrite_float_literals(text)
    if lines:
        text = mark_subscript_lines(text)
    return text


# ---------------------------------------------------------------------------
# Rewrites for the clang address-space pass
# ---------------------------------------------------------------------------
def to_addrspace_cpp(text: str) -> str:
    """MSL text -> C++ where device/constant/threadgroup are clang address spaces."""
    text = blank_attributes(text)
    masked = mask_code(text)
    edits = []
    for m in _TGDECL.finditer(masked):
        edits.append((m.start(), m.start(), "static "))
    text = _apply(text, edits)
    return text
