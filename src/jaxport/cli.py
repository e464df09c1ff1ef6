"""The `jaxport` command: `jaxport <family> <action> ...`, one sub-command per model family."""

import importlib
import logging
import sys

from jaxport.errors import JaxportError, os_error

FAMILIES = {
    "trm": "TinyRecursiveModels: demo, build datasets, train, evaluate",
    "gpt": "nanoGPT: prepare data, train, sample",
    "dream": "Dream / DiffuCoder: generate, bench, serve",
}


def _usage() -> str:
    lines = ["usage: jaxport <family> <action> [options]", "", "families:"]
    lines += [f"  {name:6s} {text}" for name, text in FAMILIES.items()]
    lines.append("\n`jaxport <family> --help` lists the actions of a family.")
    lines.append(
        "--runtime NAME=VALUE,... (any family, any action) overrides the runtime's choices, e.g. "
        '--runtime attention=xla,remat=none\n(docs/DESIGN.md, "Runtime settings").'
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    family, rest = argv[0], argv[1:]
    if family not in FAMILIES:
        print(f"jaxport: unknown family {family!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from jaxport import runtime

    family_cli = importlib.import_module(f"jaxport.{family}.cli")
    try:
        settings, rest = runtime.take_settings(rest)
        # before any work: the host settings act on the process (JAX reads its dispatch setting once)
        runtime.start(settings, trains=bool(rest) and rest[0] in family_cli.TRAINING_ACTIONS)
        from jaxport.runtime.compile_cache import keep_compiled_programs

        keep_compiled_programs()
        # orbax reports (even its failed background saves) through absl's logger; jaxport says what matters in
        # its own words
        logging.getLogger("absl").setLevel(logging.CRITICAL)
        return family_cli.main(rest) or 0
    except (JaxportError, OSError) as err:  # an output path under a file, a full disk: named like bad input
        message = err if isinstance(err, JaxportError) else os_error(err)
        print(f"jaxport {family}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
