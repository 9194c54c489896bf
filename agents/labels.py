"""The grammar of runner labels, which place agents on runners."""

import re

_LABEL = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def normalise_labels(values: object) -> list[str]:
    """Lower-case, deduplicate and sort labels, or raise ValueError saying what is wrong."""
    if isinstance(values, str) or not isinstance(values, list | tuple):
        raise ValueError("labels must be a list of strings")
    labels = set()
    for value in values:
        if not isinstance(value, str):
            raise ValueError(f"a label must be a string, not {type(value).__name__}")
        label = value.lower()
        if not _LABEL.match(label):
            raise ValueError(
                f"{value!r} is not a label: use 1 to 63 letters, digits, '.', '_' or '-',"
                " starting with a letter or digit"
            )
        labels.add(label)
    return sorted(labels)
