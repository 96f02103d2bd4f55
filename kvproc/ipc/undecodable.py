"""A reply the client cannot decode still ends its call, at once and typed (`undecodable_reply`).

Why: a reply is decoded whole against its type, so one bad field (a role's counter holding a float where the wire
says int, a payload of a newer peer) made the frame unreadable, and its call waited for its deadline and ended as
`deadline_exceeded`: the wrong error, late. The envelope is an array whose first two items are the tag and the call
id (`messages.Ok`), which a schemaless decode still reads; the call then fails with the decoder's own words.
"""

from __future__ import annotations

import msgspec

from kvproc.ipc import messages as m

OK_TAG = 10  # `messages.Ok`'s tag: a handler's reply (the other terminal messages carry no payload to go wrong)
assert m.Ok.__struct_config__.tag == OK_TAG


def failed_for(data: bytes, error: Exception, peer: str) -> m.Failed | None:
    """The `Failed` that ends the call an undecodable reply `data` answers, or None when not even its call id can
    be read (the frame is then only counted, as before)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if not (isinstance(raw, list) and len(raw) >= 2 and raw[0] == OK_TAG and type(raw[1]) is int and raw[1] > 0):
        return None
    return m.Failed(raw[1], "undecodable_reply", type(error).__name__,
                    f"{peer}'s reply could not be decoded: {str(error)[:300]}")
