"""Typed configs: pydantic models validate a plain mapping (from YAML, overrides, flags), and a bad
key or value becomes one JaxportError naming the key, the value and what is expected."""

import difflib

import pydantic

from jaxport.errors import JaxportError


def _close_matches(key: str, model: type[pydantic.BaseModel], loc: tuple) -> str:
    """ "; did you mean ..." for an unknown key, from the fields of the model that holds it."""
    node = model
    for part in loc[:-1]:
        field = node.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)):
            return ""
        node = annotation
    close = difflib.get_close_matches(key, sorted(node.model_fields), n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def validate(
    model: type[pydantic.BaseModel], data: dict, where: str, what: str = "config key", unknown_key_hint: str = ""
):
    """`model(**data)`, or one JaxportError for the first bad entry (`where` names the source, `what` the
    kind of key)."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        loc = tuple(first["loc"])
        key = ".".join(str(p) for p in loc)
        if first["type"] == "extra_forbidden":
            raise JaxportError(
                f"unknown {what} {key!r} in {where}{_close_matches(str(loc[-1]), model, loc)}{unknown_key_hint}"
            ) from None
        if first["type"] == "missing":
            raise JaxportError(f"{where} lacks the {what} {key!r}") from None
        if first["type"] == "value_error":  # a check across keys; its message names them
            raise JaxportError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
        message = first["msg"][0].lower() + first["msg"][1:]
        raise JaxportError(f"{what} {key}={first['input']!r} in {where}: {message}") from None
