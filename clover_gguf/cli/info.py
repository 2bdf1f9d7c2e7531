"""``clover-gguf info``: a GGUF file's metadata and tensor table."""
from __future__ import annotations

import json
import sys

from .common import EXIT_OK, UsageError, check_model_path


def _summarise(v, max_items: int = 8) -> str:
    if isinstance(v, (list, tuple)):
        if len(v) <= max_items:
            return "[" + ", ".join(_summarise(x) for x in v) + "]"
        head = ", ".join(_summarise(x) for x in v[:max_items])
        return f"[{head}, ...] ({len(v)} items)"
    if isinstance(v, str):
        s = v if len(v) <= 80 else v[:77] + "..."
        return json.dumps(s, ensure_ascii=False) + (f" ({len(v)} chars)" if len(v) > 80 else "")
    if isinstance(v, float):
        return f"{v:.7g}"  # float32 values: 7 significant digits
    return str(v)


def _tensor_field(t: dict, *names, default=None):
    for n in names:
        if n in t:
            return t[n]
    return default


def cmd(a) -> int:
    from .._ffi import CloverError
    from ..gguf import GGUFFile

    if a.file and a.model and a.file != a.model:
        raise UsageError(f"FILE, -m/--model: two files ({a.file}, {a.model}); give one, as FILE or -m FILE")
    a.model = a.file or a.model
    if not a.model:
        raise UsageError("-m/--model: required (info FILE or info -m FILE)")
    check_model_path(a.model)
    try:
        f = GGUFFile(a.model)
    except (CloverError, ValueError) as e:
        msg = str(e)
        raise UsageError(msg if a.model in msg else f"{a.model}: {msg}") from None
    with f:
        md = f.metadata
        out = sys.stdout
        print(f"file: {a.model}", file=out)
        print(f"metadata: {len(md)} keys", file=out)
        width = max((len(k) for k in md), default=0)
        for k, v in md.items():
            print(f"  {k:<{width}}  {_summarise(v)}", file=out)
        tensors = f.tensors
        print(f"tensors: {len(tensors)}", file=out)
        rows = []
        total = 0
        for t in tensors:
            shape = _tensor_field(t, "shape", "ne", default=())
            typ = _tensor_field(t, "type_name", "type", default="?")
            nbytes = int(_tensor_field(t, "nbytes", "n_bytes", default=0))
            off = _tensor_field(t, "offset", default="")
            total += nbytes
            rows.append((str(t.get("name")), str(typ), "{" + ", ".join(str(int(x)) for x in shape) + "}",
                         str(nbytes), str(off)))
        hdr = ("name", "type", "shape (ne)", "bytes", "offset")
        w = [max(len(r[i]) for r in rows + [hdr]) for i in range(5)]
        print("  " + "  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)), file=out)
        for r in rows:
            print("  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)), file=out)
        print(f"total tensor bytes: {total}", file=out)
    return EXIT_OK


def add_parser(sub) -> None:
    i = sub.add_parser("info", help="print GGUF metadata and the tensor table")
    i.add_argument("file", nargs="?", default="", metavar="FILE", help="GGUF file (or -m FILE)")
    # llama.cpp's -m; not None, so that cli.main gives no embedded default: info reads a named file
    i.add_argument("-m", "--model", default="", metavar="FILE", help="GGUF file (llama.cpp's -m; or FILE)")
    i.set_defaults(func=cmd)
