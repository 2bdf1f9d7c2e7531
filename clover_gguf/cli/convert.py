"""``clover-gguf convert``: the HF -> GGUF converter (:mod:`clover_gguf.convert`), which parses its
own arguments."""


def cmd(argv: list[str]) -> int:
    # Imported lazily: the converter is only needed here.
    from ..convert.convert import main as convert_main

    rc = convert_main(argv)
    return 0 if rc is None else int(rc)


def add_parser(sub) -> None:
    # Parsed by the converter itself (see main); listed here for --help.
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF "
                   "(clover-gguf convert HF_DIR -o OUT.gguf [--outtype TYPE] [--split | --diffusion-only] "
                   "[--arch clover_moe|qwen35moe]; clover-gguf convert --help lists the types and options)",
                   add_help=False)

