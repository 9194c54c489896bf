"""The grammar of container image references (Docker's distribution reference format)."""

import re

# name components, optional registry host[:port] first, optional :tag, optional @digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
# As Docker reads a reference: the first component is a registry host only when it has a dot or
# a port, or is localhost; otherwise it is part of the (lower-case) name.
_HOST = (
    rf"(?:(?:localhost(?::[0-9]+)?|{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})+(?::[0-9]+)?"
    rf"|{_DOMAIN_LABEL}:[0-9]+)/)"
)
_REFERENCE = re.compile(
    rf"{_HOST}?{_COMPONENT}(?:/{_COMPONENT})*(?::[\w][\w.-]{{0,127}})?(?:@sha256:[0-9a-f]{{64}})?"
)


def validate_image_reference(value: str) -> str:
    """Return the reference unchanged, or raise ValueError saying what is wrong."""
    if not value:
        raise ValueError("an image reference must not be empty")
    if len(value) > 255:
        raise ValueError("an image reference must be at most 255 characters")
    if not _REFERENCE.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an image reference (expected name[:tag][@sha256:digest],"
            " lower-case name, e.g. covey/base:bookworm)"
        )
    return value
