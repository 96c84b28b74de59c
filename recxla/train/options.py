"""Options declared once: a dataclass field carries its flag, help, choices, parser and the path
it applies to, and the argparse parser, the path check and the config's values all derive from
those fields.

    steps: int = option(100, "total steps", group="training", parse=int_at_least(1))

- flag: "--" + the field name with dashes (or `flag=`); older spellings in `aliases`;
- a bool field is a switch, `--x/--no-x` (argparse.BooleanOptionalAction);
- applies: "both", "recxla" or "torchrec" (the path of --baseline). Given on the other path,
  the option is an error (`path_errors`); left at its default, it is ignored there;
- the parser's defaults are argparse.SUPPRESS, so that the namespace holds exactly the options
  given on the command line: the config takes the field's default for the others (one default
  per option), and checks can tell "given" from "left at its default".
"""

import argparse
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

BOTH, RECXLA, TORCHREC = "both", "recxla", "torchrec"
PATHS = (BOTH, RECXLA, TORCHREC)
# The command-line groups, in --help order.
GROUPS = ("model", "training", "communication and sharding", "overlap pipeline",
          "topology", "data", "run")


def option(default: Any, help: str, *, group: str, applies: str = BOTH,
           choices: Optional[Sequence[str]] = None, parse: Optional[Callable] = None,
           flag: Optional[str] = None, aliases: Sequence[str] = (), metavar: Optional[str] = None,
           default_text: Optional[str] = None, repeat: bool = False):
    """A TrainConfig field declared as a command-line option.

    default: the option's one default; default_text: how --help states it when the config
    resolves it from other options (e.g. "the dataset's, else 64"). repeat: the flag may be
    given several times; the value is the tuple of what was given, in order."""
    if group not in GROUPS:
        raise ValueError(f"option: group must be one of {GROUPS}, got {group!r}")
    if applies not in PATHS:
        raise ValueError(f"option: applies must be one of {PATHS}, got {applies!r}")
    meta = dict(help=help, group=group, applies=applies, choices=choices, parse=parse,
                flag=flag, aliases=tuple(aliases), metavar=metavar, default_text=default_text,
                repeat=repeat)
    return dataclasses.field(default=default, metadata={"option": meta})


def options_of(cls) -> List[Tuple[dataclasses.Field, dict]]:
    """(field, option metadata) of every option field of dataclass `cls`, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata["option"]["flag"] or "--" + field.name.replace("_", "-")


def default_text(field: dataclasses.Field) -> str:
    meta = field.metadata["option"]
    if meta["default_text"] is not None:
        return meta["default_text"]
    value = field.default
    if field.type in (bool, "bool"):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return "none" if value is None else str(value)


def _metavar(field: dataclasses.Field) -> Optional[str]:
    """The value's placeholder in --help: the declared one, else N (ints), X (numbers),
    N,N,... (layer sizes)."""
    meta = field.metadata["option"]
    if meta["metavar"] is not None or meta["choices"] is not None:
        return meta["metavar"]
    parse = meta["parse"]
    if parse is layer_sizes:
        return "N,N,..."
    if parse in (positive_float, non_negative_float, fraction):
        return "X"
    return "N" if parse is not None else None


def _help(field: dataclasses.Field) -> str:
    meta = field.metadata["option"]
    path = {BOTH: "", RECXLA: "recxla path only; ", TORCHREC: "--baseline torchrec only; "}
    return f"{meta['help']} ({path[meta['applies']]}default: {default_text(field)})"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors go to `on_error(message)` (which exits) instead of
    argparse's usage text and exit."""

    def __init__(self, on_error: Optional[Callable[[str], None]] = None, **kwargs):
        super().__init__(**kwargs)
        self.on_error = on_error

    def error(self, message: str):
        if self.on_error is None:
            super().error(message)
        self.on_error(message)
        raise SystemExit(2)  # on_error exits; this keeps argparse's promise if it returns


def build_parser(cls, on_error: Optional[Callable[[str], None]] = None,
                 **parser_kwargs) -> argparse.ArgumentParser:
    """The argparse parser of dataclass `cls`'s option fields, grouped as declared; its errors
    (and the checks' that call parser.error) go to `on_error(message)` when given."""
    parser = _Parser(on_error, argument_default=argparse.SUPPRESS, **parser_kwargs)
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for field, meta in options_of(cls):
        kwargs: Dict[str, Any] = dict(dest=field.name, help=_help(field))
        if field.type in (bool, "bool"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if meta["choices"] is not None:
                kwargs["choices"] = tuple(meta["choices"])
            if meta["parse"] is not None:
                kwargs["type"] = meta["parse"]
            if _metavar(field) is not None:
                kwargs["metavar"] = _metavar(field)
            if meta["repeat"]:
                kwargs["action"] = "append"
        groups[meta["group"]].add_argument(flag_of(field), *meta["aliases"], **kwargs)
    return parser


def path_errors(cls, given: Dict[str, Any], path: str) -> List[str]:
    """Messages for the options in `given` that do not apply to `path` ("recxla"/"torchrec")."""
    errors = []
    for field, meta in options_of(cls):
        if field.name not in given or meta["applies"] in (BOTH, path):
            continue
        if meta["applies"] == RECXLA:
            errors.append(f"{flag_of(field)} applies to the recxla path only; the TorchRec "
                          "baseline (--baseline torchrec) runs TorchRec's own sharder and "
                          "TrainPipelineSparseDist")
        else:
            errors.append(f"{flag_of(field)} applies to --baseline torchrec only")
    return errors


def values(cls, given: Dict[str, Any]) -> Dict[str, Any]:
    """Every option field's value: the given one, else the field's default."""
    return {field.name: tuple(given[field.name]) if meta["repeat"] and field.name in given
            else given.get(field.name, field.default) for field, meta in options_of(cls)}


# Parsers of option values: argparse turns their ArgumentTypeError into "--flag: message".

def int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {value}")
        return value

    parse.__name__ = f"int >= {lo}"
    return parse


def _float_where(text: str, holds, limit: str) -> float:
    """`text` as a float for which holds(value) is true; else argparse's error naming `limit`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number {limit}, got {text!r}") from None
    if not holds(value):
        raise argparse.ArgumentTypeError(f"must be a number {limit}, got {value}")
    return value


def positive_float(text: str) -> float:
    return _float_where(text, lambda v: v > 0, "> 0")


def non_negative_float(text: str) -> float:
    return _float_where(text, lambda v: v >= 0, ">= 0")


def fraction(text: str) -> float:
    return _float_where(text, lambda v: 0 < v < 1, "in (0, 1)")


def layer_sizes(text: str) -> Tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1, got {text!r}")
    return sizes


def table_sizes(text: str) -> Tuple[Tuple[str, int], ...]:
    """"name=rows,name=rows" -> ((name, rows), ...)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, rows = part.partition("=")
        try:
            n = int(rows)
        except ValueError:
            n = 0
        if not sep or not name.strip() or n < 1:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated TABLE=ROWS with ROWS an int >= 1, got {part!r}")
        out.append((name.strip(), n))
    return tuple(out)


def embedding_dims(text: str) -> Tuple:
    """"auto", "auto:KEEP" (KEEP in (0, 1]) -> ("auto", keep); "name=dim,..." -> ((name, dim),
    ...) with dims multiples of 4 (the FP8 codec's vector loads)."""
    if text == "auto" or text.startswith("auto:"):
        keep = text.partition(":")[2] or "0.5"
        try:
            value = float(keep)
        except ValueError:
            value = 0.0
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"auto:KEEP needs KEEP in (0, 1], got {keep!r}")
        return ("auto", value)
    try:
        pairs = table_sizes(text)
    except argparse.ArgumentTypeError:
        pairs = ()
    if not pairs or any(d % 4 for _, d in pairs):
        raise argparse.ArgumentTypeError(
            f"must be auto, auto:KEEP or comma-separated TABLE=DIM with DIM a multiple of 4, "
            f"got {text!r}")
    return pairs


def markdown_reference(cls) -> str:
    """The options of dataclass `cls` as Markdown tables, one per group: flag, path, default,
    help (docs/training.md holds this text; a test keeps the two equal)."""
    path = {BOTH: "both", RECXLA: "recxla", TORCHREC: "torchrec"}
    lines = []
    for group in GROUPS:
        rows = [(f, m) for f, m in options_of(cls) if m["group"] == group]
        if not rows:
            continue
        lines += [f"**{group}**", "", "| option | path | default | what it sets |",
                  "|---|---|---|---|"]
        for field, meta in rows:
            flag = flag_of(field)
            if field.type in (bool, "bool"):
                flag = f"{flag}, --no-{flag[2:]}"
            elif meta["choices"] is not None:
                flag = f"{flag} {{{','.join(meta['choices'])}}}"
            elif _metavar(field) is not None:
                flag = f"{flag} {_metavar(field)}"
            cell = lambda s: s.replace("|", "\\|")  # noqa: E731
            lines.append(f"| `{cell(flag)}` | {path[meta['applies']]} | "
                         f"{cell(default_text(field))} | {cell(meta['help'])} |")
        lines.append("")
    return "\n".join(lines)
