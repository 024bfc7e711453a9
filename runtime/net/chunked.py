"""Calls of any size: the request and the reply cross as a stream of pieces.

gRPC caps one message (atoll.net.rpc.MAX_MESSAGE_BYTES), and a model's weights ride in three calls:
the submitted program (SubmitPipeline), each worker's stage programs (LoadPlan) and the state
read back (GetState). Those calls go through the ``Chunked`` RPC of either service instead. The
caller sends the serialized message in pieces of ``CHUNK_BYTES``, its large bytes fields (a
program, a tensor's data) lifted out first: they follow the rest in pieces of their own. The
first piece names the method, the sizes and where each lifted field goes. The service puts the message
back together, runs the method as if called directly (same checks, same errors) and sends its
reply back the same way. Protobuf's own 2 GiB limit applies to the message without its lifted
fields only, so a model is limited by memory, not by a message size.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator

from google.protobuf.message import DecodeError

from atoll._rpc import atoll_pb2 as pb
from atoll.errors import InvalidInput

CHUNK_BYTES = 4 << 20  # measured: 4 MiB pieces stream fastest here (~200 MB/s in one process; 16 MiB: 145)
LIFT_BYTES = 1 << 20
"""Bytes fields larger than this travel beside the message. Lifting is the cheaper way for any
size: with upb, reading such a field out and setting it back costs about 2.3 s/GB here, where
serializing the message whole costs 2.5 s/GB, and merely asking its size (ByteSize) another 2.6."""
CHUNKED_METHODS = frozenset({"SubmitPipeline", "LoadPlan", "GetState"})


@functools.cache
def _holds_bytes(descriptor) -> bool:
    """Whether a message of this type can hold a bytes field at any depth: the walk below skips
    those that cannot (a 1,024-stage job's plan repeats its 1,023 dataflow edges to every worker)."""
    seen, todo = {descriptor}, [descriptor]
    while todo:
        for field in todo.pop().fields:
            if field.type == field.TYPE_BYTES:
                return True
            if field.type == field.TYPE_MESSAGE and field.message_type not in seen:
                seen.add(field.message_type)
                todo.append(field.message_type)
    return False


def _large_fields(message, path=()) -> list[tuple[tuple, bytes]]:
    """(path, value) of every bytes field above LIFT_BYTES, at any depth; a path is a tuple of
    (field name, index in a repeated field or -1)."""
    found = []
    for field, value in message.ListFields():
        if field.type == field.TYPE_BYTES and not field.is_repeated:
            if len(value) > LIFT_BYTES:
                found.append(((*path, (field.name, -1)), value))
        elif (
            field.type == field.TYPE_MESSAGE
            and not field.message_type.GetOptions().map_entry
            and _holds_bytes(field.message_type)
        ):
            if field.is_repeated:
                for i, sub in enumerate(value):
                    found += _large_fields(sub, (*path, (field.name, i)))
            else:
                found += _large_fields(value, (*path, (field.name, -1)))
    return found


def _holder(message, path: tuple):
    """The message holding the field at the end of ``path``, and that field's name."""
    for name, index in path[:-1]:
        message = getattr(message, name)
        if index >= 0:
            message = message[index]
    return message, path[-1][0]


def pieces(method: str, message, keep: bool = True) -> Iterator[pb.Chunk]:
    """``message`` as Chunks; its large fields are lifted out while the rest is serialized, then
    put back, so the caller's message is unchanged. ``keep=False`` leaves them out: for a message
    built for this one call, putting a model's weights back is a copy of them for nothing."""
    lifted = _large_fields(message)
    for path, _ in lifted:
        holder, name = _holder(message, path)
        holder.ClearField(name)
    try:
        skeleton = message.SerializeToString()
    finally:
        for path, value in lifted if keep else ():
            holder, name = _holder(message, path)
            setattr(holder, name, value)
    first = True
    for data in (skeleton, *(value for _, value in lifted)):
        view = memoryview(data)
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            chunk = pb.Chunk(data=bytes(view[start : start + CHUNK_BYTES]))
            if first:
                chunk.method = method
                chunk.sizes.extend([len(skeleton), *(len(v) for _, v in lifted)])
                chunk.paths.extend(json.dumps(p) for p, _ in lifted)
                first = False
            yield chunk


def available_bytes() -> int:
    """Memory this machine can still give (MemAvailable), or no limit where /proc is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def assemble(chunks: Iterable[pb.Chunk]) -> tuple[pb.Chunk, list[bytes]]:
    """The first piece (method, sizes, paths) and the payload's parts as it announces them: the
    message without its lifted fields, then each lifted field. ``pieces`` cuts each part on its
    own, so each is joined from its own pieces, with no copy of the whole payload (a field of one
    piece is not copied at all). Refuses a payload this machine could not hold rather than running
    out of memory gathering it."""
    head, received, total, limit = None, [], 0, available_bytes() // 2
    for chunk in chunks:
        head = chunk if head is None else head
        data = chunk.data  # upb copies a bytes field at every read: read it once
        total += len(data)
        if total > limit:
            raise InvalidInput(f"a chunked {head.method} call exceeds the {limit} bytes this machine can take now")
        if data:
            received.append(data)
    head = head or pb.Chunk()
    sizes = list(head.sizes) or [total]
    return head, _aligned(received, sizes) or _cut(b"".join(received), sizes)


def _aligned(received: list[bytes], sizes: list[int]) -> list[bytes] | None:
    """Each part joined from the pieces that make it up, or None where a piece crosses a part's end."""
    parts, i = [], 0
    for size in sizes:
        run, n = [], 0
        while n < size and i < len(received):
            run.append(received[i])
            n += len(received[i])
            i += 1
        if n != size:
            return None
        parts.append(run[0] if len(run) == 1 else b"".join(run))
    return parts if i == len(received) else None


def _cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """The parts of pieces cut some other way (or that do not add up: ``parse`` refuses those)."""
    if any(n < 0 for n in sizes) or sum(sizes) != len(data):
        return [data]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return [data[a:b] for a, b in zip(starts, starts[1:])]


def message_types(service: str, method: str):
    """The request and reply classes of ``service.method``; InvalidInput for a method not chunked."""
    if method not in CHUNKED_METHODS:
        raise InvalidInput(f"{method!r} is not a chunked method (chunked: {', '.join(sorted(CHUNKED_METHODS))})")
    desc = pb.DESCRIPTOR.services_by_name[service].methods_by_name.get(method)
    if desc is None:
        raise InvalidInput(f"the {service} service has no method {method!r}")
    return getattr(pb, desc.input_type.name), getattr(pb, desc.output_type.name)


def parse(cls, head: pb.Chunk, parts: list[bytes], what: str):
    """The message ``pieces`` sent: its skeleton parsed, its lifted fields put back in place."""
    sizes = list(head.sizes) or [sum(len(p) for p in parts)]
    if len(parts) != len(sizes) or [len(p) for p in parts] != sizes or len(head.paths) != len(sizes) - 1:
        raise InvalidInput(f"{what}: the pieces do not add up to what their first piece announced")
    try:
        message = cls.FromString(parts[0])
    except DecodeError as e:
        raise InvalidInput(f"{what}: malformed {cls.__name__}: {e}") from None
    for raw, value in zip(head.paths, parts[1:]):
        try:
            holder, name = _holder(message, tuple(tuple(step) for step in json.loads(raw)))
            setattr(holder, name, value)
        except (ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise InvalidInput(f"{what}: no bytes field at {raw}: {type(e).__name__}: {e}") from None
    return message


def serve(servicer, service: str, chunks: Iterable[pb.Chunk], context) -> Iterator[pb.Chunk]:
    """The body of a service's ``Chunked`` RPC: run the named method on the whole request."""
    head, parts = assemble(chunks)
    request_type, _ = message_types(service, head.method)
    handler = getattr(type(servicer), head.method)
    # under its rpc_handler (whose errors this RPC's own handler reports): the method's checks still run
    request = parse(request_type, head, parts, head.method)
    del parts  # the request holds its own copy: a model's weights are not held twice while it runs
    reply = handler.__wrapped__(servicer, request, context)
    yield from pieces("", reply, keep=False)
