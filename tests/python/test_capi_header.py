#!/usr/bin/env python3
"""The Python binding (python/mkernel/_capi.py) against the C header (include/mkernel/c_api.h).

Every function the header declares is declared by the binding with the same arity, argument
types and result type, and nothing more; the error codes, the ABI version and mk_comm_info_t
agree. Types map as ctypes sees them: handles and device memory are addresses (c_void_p);
out-parameters (named `out`), strides, shard_rows and parameters named host_* are host memory, typed
(POINTER(...)); callbacks are the binding's CFUNCTYPEs of the same signature. No GPU and no library needed: run by ctest (lint).
"""
import ctypes
import os
import re
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
from mkernel import _capi  # noqa: E402

HEADER = os.path.join(ROOT, "include", "mkernel", "c_api.h")

SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float,
           "size_t": ctypes.c_size_t}
HANDLES = {"mk_comm_t", "mk_fused_t", "mk_ring_t", "mk_ring_bwd_t", "mk_moe_t", "mk_coll_t", "mk_moe_layer_t"}


def header_text():
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)  # comments
    return text


def parse_functions(text):
    """name -> (result type, [(type, name)]) for every MK_C_EXPORT declaration."""
    out = {}
    for m in re.finditer(r"MK_C_EXPORT\s+([^;{]*?)\b(mk_\w+)\s*\(([^)]*)\)\s*;", text):
        res, name, params = m.group(1).strip(), m.group(2), m.group(3).strip()
        args = []
        if params and params != "void":
            for p in params.split(","):
                p = " ".join(p.split())
                pm = re.match(r"(.*?)(\w+)$", p)
                args.append((pm.group(1).strip(), pm.group(2)))
        out[name] = (res, args)
    return out


def parse_callbacks(text):
    """typedef name -> (result type, [parameter types])."""
    out = {}
    for m in re.finditer(r"typedef\s+(.+?)\(\*\s*(\w+)\)\s*\(([^)]*)\)\s*;", text):
        params = [" ".join(p.split()) for p in m.group(3).split(",")]
        out[m.group(2)] = (m.group(1).strip(), [re.match(r"(.*?)(\w+)$", p).group(1).strip() for p in params])
    return out


def base(t):
    return t.replace("const", "").replace("*", "").strip()


def expected_ctype(ctype, pname, callbacks):
    """The ctypes type the binding must use for a C parameter or result."""
    ctype = " ".join(ctype.split())
    stars = ctype.count("*")
    b = base(ctype)
    if b in callbacks and stars == 0:
        return ("callback", b)
    if b in HANDLES:
        return ctypes.c_void_p if stars == 0 else ctypes.POINTER(ctypes.c_void_p)
    if stars == 0:
        return SCALARS[b]
    if b == "char" and stars == 1:
        # const char*: a string passed in; char*: a buffer the callee fills (an address)
        return ctypes.c_char_p if "const" in ctype else ctypes.c_void_p
    host = pname is not None and (pname == "out" or pname.endswith("strides") or pname == "strides12" or
                                  pname == "shard_rows" or pname.startswith("host_"))
    if not host:
        return ctypes.c_void_p  # device memory (or an opaque context), passed as an address
    if stars == 2 or b == "void":
        return ctypes.POINTER(ctypes.c_void_p)
    if b == "mk_comm_info_t":
        return ctypes.POINTER(_capi.CommInfo)
    return ctypes.POINTER(SCALARS[b])


def same_ctype(got, want):
    if got is want:
        return True
    # POINTER(x) objects are cached per x, but compare by target to be safe.
    return (hasattr(got, "_type_") and hasattr(want, "_type_") and getattr(got, "__name__", "").startswith("LP_")
            and got._type_ is want._type_)


class CapiHeader(unittest.TestCase):
    def setUp(self):
        self.text = header_text()
        self.funcs = parse_functions(self.text)
        self.callbacks = parse_callbacks(self.text)
        self.sigs = _capi.signatures()

    def test_header_parsed(self):
        # The parser saw the whole header (a declaration it missed would escape the comparison).
        decls = len(re.findall(r"^MK_C_EXPORT ", self.text, re.M))
        self.assertEqual(len(self.funcs), decls)
        self.assertGreaterEqual(len(self.funcs), 26)
        self.assertEqual(set(self.callbacks), {"mk_store_set_fn", "mk_store_get_fn", "mk_store_erase_fn",
                                               "mk_store_why_fn"})

    def test_same_functions(self):
        self.assertEqual(sorted(self.funcs), sorted(self.sigs),
                         "functions in the header but not the binding, or the other way round")

    def test_every_signature(self):
        cb_types = {"mk_store_set_fn": _capi.STORE_SET, "mk_store_get_fn": _capi.STORE_GET,
                    "mk_store_erase_fn": _capi.STORE_ERASE, "mk_store_why_fn": _capi.STORE_WHY}
        for name, (res, args) in self.funcs.items():
            with self.subTest(function=name):
                got_args, got_res = self.sigs[name]
                self.assertEqual(len(got_args), len(args), f"{name}: arity")
                want_res = expected_ctype(res, None, self.callbacks)
                self.assertTrue(same_ctype(got_res, want_res), f"{name}: result {got_res} vs {res}")
                for i, ((ctype, pname), got) in enumerate(zip(args, got_args)):
                    want = expected_ctype(ctype, pname, self.callbacks)
                    if isinstance(want, tuple):
                        self.assertIs(got, cb_types[want[1]], f"{name} argument {i} ({pname})")
                    else:
                        self.assertTrue(same_ctype(got, want), f"{name} argument {i} ({ctype} {pname}): {got}")

    def test_callbacks(self):
        pairs = {"mk_store_set_fn": _capi.STORE_SET, "mk_store_get_fn": _capi.STORE_GET,
                 "mk_store_erase_fn": _capi.STORE_ERASE, "mk_store_why_fn": _capi.STORE_WHY}
        for name, fn in pairs.items():
            with self.subTest(callback=name):
                res, params = self.callbacks[name]
                # The callback's own pointers: the key is a C string, len/found are host out-params.
                want = [expected_ctype(p, "out" if p in ("size_t*", "int*") else None, self.callbacks)
                        for p in params]
                self.assertEqual(len(fn._argtypes_), len(want))
                for got, w in zip(fn._argtypes_, want):
                    self.assertTrue(same_ctype(got, w), f"{name}: {got} vs {w}")
                self.assertTrue(same_ctype(fn._restype_, expected_ctype(res, None, self.callbacks)))

    def test_codes_and_version(self):
        enum = re.search(r"typedef enum mk_code \{(.*?)\}", self.text, re.S).group(1)
        values = {int(v): n for n, v in re.findall(r"(MK_\w+)\s*=\s*(\d+)", enum)}
        self.assertEqual(sorted(values), sorted(_capi.CODES))
        for v, n in values.items():
            self.assertEqual(n[3:].replace("_", " ").lower(), _capi.CODES[v].lower(), f"code {v}")
        version = int(re.search(r"#define MK_C_API_VERSION (\d+)", self.text).group(1))
        self.assertEqual(version, _capi.API_VERSION)

    def test_comm_info_fields(self):
        body = re.search(r"typedef struct mk_comm_info \{(.*?)\}", self.text, re.S).group(1)
        names = re.findall(r"(\w+)\s*[,;]", body)
        self.assertEqual(names, [f for f, _ in _capi.CommInfo._fields_])


if __name__ == "__main__":
    unittest.main()
