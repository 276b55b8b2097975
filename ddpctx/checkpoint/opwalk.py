"""A pickle's opcodes followed with a model of the unpickler's stack, in time linear in its size.

:mod:`ddpctx.checkpoint.claims` weighs what a checkpoint pickle claims before
it is unpickled; this module reads the opcodes for it. It follows each opcode
as the unpickler would, on a model of its stack: plain values (ints, strings,
tuples, lists) are built, so a call's arguments can be weighed; everything
else -- a dict, an object, what a call returns unless the claims say more --
is :data:`OPAQUE`. Each global a pickle names, and each call and persistent id,
goes to the :class:`Claimant`. Nothing the pickle claims is allocated: a
``BINBYTES8`` of 50 GiB is a slice of the bytes there (refused as truncated
when they are not), a memo index a key of a dict.

The opcodes are read straight from the bytes (``struct``'s ``unpack_from`` at a
position, the common ones first), not through :func:`pickletools.genops`,
which costs a generator step, an argument reader call and a tuple per opcode:
the walk costs less than torch's own unpickling of the same pickle (which is
Python code too; BENCHMARKS.md, "What a reader's walks cost"). Each opcode is
one step, and what a step does is bounded by the bytes that built its operands
-- except the arguments of a call, whose ints are counted against
:data:`WORK` per byte of the pickle (a list of a million ints passed to a
million calls would be 10^12 steps): past it, the pickle is refused.

Example:
    >>> import pickle
    >>> class Calls:
    ...     said: list[str] = []
    ...     def call(self, callee, args):
    ...         self.said.append(str(callee))
    ...         return OPAQUE
    ...     def storage(self, pid):
    ...         return OPAQUE
    >>> calls, data = Calls(), pickle.dumps({"w": bytearray(3)}, protocol=2)
    >>> walk(data, calls, 0) == len(data)  # the position just past its STOP
    True
    >>> calls.said
    ['_codecs.encode', 'builtins.bytearray']
"""

from __future__ import annotations

import io
import pickletools
import struct
from typing import Any, Protocol

__all__ = ["OPAQUE", "WORK", "Claimant", "Global", "Refused", "ints", "walk"]

#: How many ints of calls' arguments a pickle may have weighed, per byte of it (and 1 Mi at
#: least): a tensor's size and stride are a few ints in tens of bytes of pickle, under 1 a byte.
WORK = 4


class Global(str):
    """A global a pickle names (``module.name``; protocol 2's ``__builtin__`` as ``builtins``)."""

    def __new__(cls, name: str) -> Global:
        return super().__new__(cls, name.replace("__builtin__.", "builtins.", 1))


class _Opaque:
    """Any value the model does not follow (a dict, a tensor, an object)."""


OPAQUE = _Opaque()


class Refused(Exception):
    """What in the pickle is refused, said as a phrase."""


class Claimant(Protocol):
    """What the walk reports to: each call (a global and its arguments) and persistent id."""

    def call(self, callee: Any, args: Any) -> Any:
        """What calling ``callee`` with ``args`` claims; the result as the model follows it."""

    def storage(self, pid: Any) -> Any:
        """A persistent id; the value it stands for, as the model follows it."""


def ints(value: Any) -> list[int]:
    """The ints of an argument: itself, or those of a tuple or list of ints (a size)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, int) and not isinstance(item, bool)]
    return []


class _Budget:
    """The ints of calls' arguments weighed so far, against :data:`WORK` per byte."""

    def __init__(self, size: int) -> None:
        self.left = max(1 << 20, WORK * size)

    def spend(self, args: Any) -> None:
        """Charge a call's arguments: the items of each sequence in them, two levels deep
        (a call's arguments may hold another's: ``_rebuild_from_type_v2``)."""
        if isinstance(args, tuple):
            for arg in args:
                if isinstance(arg, (tuple, list)):
                    self.left -= len(arg)
                    for item in arg:
                        if isinstance(item, (tuple, list)):
                            self.left -= len(item)
            if self.left < 0:
                raise Refused(
                    "calls whose arguments add up to more ints than the pickle could hold "
                    f"({WORK} per byte: the same long list passed to call after call)"
                )


_U1 = struct.Struct("<B").unpack_from
_U2 = struct.Struct("<H").unpack_from
_U4 = struct.Struct("<I").unpack_from
_I4 = struct.Struct("<i").unpack_from
_U8 = struct.Struct("<Q").unpack_from
_F8 = struct.Struct(">d").unpack_from
_REFUSED = {0x97, 0x98, 0x82, 0x83, 0x84}  # NEXT_BUFFER, READONLY_BUFFER, EXT1, EXT2, EXT4
_BY_CODE = {op.code.encode("latin-1")[0]: op for op in pickletools.opcodes}


def _pop(stack: list[Any], count: int = 1) -> list[Any]:
    if len(stack) < count:
        raise Refused("a pickle that pops an empty stack")
    items = stack[len(stack) - count :]
    del stack[len(stack) - count :]
    return items


def _pop_mark(stack: list[Any], marks: list[int]) -> list[Any]:
    if not marks:
        raise Refused("a pickle whose MARKs do not match")
    start = marks.pop()
    items = stack[start:]
    del stack[start:]
    return items


def _counted(data: bytes, at: int, length: int) -> bytes:
    """``length`` bytes of ``data`` from ``at``; ValueError when fewer are there (truncated)."""
    if at + length > len(data):
        raise ValueError(f"a string of {length} bytes at byte {at}, past the pickle's end")
    return data[at : at + length]


def walk(data: bytes, claimant: Claimant, start: int, size: int | None = None) -> int:
    """Follow the pickle at ``data[start:]`` to its STOP; the position just past it.

    ``size``: the bytes the work of calls is weighed against (the file's; ``len(data)``
    by default). :class:`Refused` for what the model refuses; ValueError, IndexError,
    KeyError, TypeError or OverflowError for a pickle that does not parse.
    """
    budget = _Budget(len(data) if size is None else size)
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    push = stack.append
    pos = start
    while True:
        code = data[pos]
        pos += 1
        if code == 0x71:  # BINPUT
            memo[data[pos]] = stack[-1] if stack else OPAQUE
            pos += 1
        elif code == 0x28:  # MARK
            marks.append(len(stack))
        elif code == 0x58:  # BINUNICODE
            (length,) = _U4(data, pos)
            push(str(_counted(data, pos + 4, length), "utf-8", "surrogatepass"))
            pos += 4 + length
        elif code == 0x4B:  # BININT1
            push(data[pos])
            pos += 1
        elif code == 0x68:  # BINGET
            push(memo.get(data[pos], OPAQUE))
            pos += 1
        elif code == 0x75 or code == 0x90:  # SETITEMS, ADDITEMS
            _pop_mark(stack, marks)
        elif code == 0x4E:  # NONE
            push(None)
        elif code == 0x4A:  # BININT
            push(_I4(data, pos)[0])
            pos += 4
        elif code == 0x74:  # TUPLE
            push(tuple(_pop_mark(stack, marks)))
        elif 0x85 <= code <= 0x87:  # TUPLE1, TUPLE2, TUPLE3
            push(tuple(_pop(stack, code - 0x84)))
        elif code == 0x7D or code == 0x8F:  # EMPTY_DICT, EMPTY_SET
            push(OPAQUE)
        elif code == 0x52 or code == 0x81:  # REDUCE, NEWOBJ
            callee, args = _pop(stack, 2)
            budget.spend(args)
            push(claimant.call(callee, args))
        elif code == 0x51:  # BINPERSID
            push(claimant.storage(_pop(stack)[0]))
        elif code == 0x72:  # LONG_BINPUT
            memo[_U4(data, pos)[0]] = stack[-1] if stack else OPAQUE
            pos += 4
        elif code == 0x6A:  # LONG_BINGET
            push(memo.get(_U4(data, pos)[0], OPAQUE))
            pos += 4
        elif code == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1] if stack else OPAQUE
        elif code == 0x4D:  # BININT2
            push(_U2(data, pos)[0])
            pos += 2
        elif code == 0x47:  # BINFLOAT
            push(_F8(data, pos)[0])
            pos += 8
        elif code == 0x88 or code == 0x89:  # NEWTRUE, NEWFALSE
            push(code == 0x88)
        elif code == 0x5D:  # EMPTY_LIST
            push([])
        elif code == 0x29:  # EMPTY_TUPLE
            push(())
        elif code == 0x65:  # APPENDS
            items = _pop_mark(stack, marks)
            if stack and isinstance(stack[-1], list):
                stack[-1].extend(items)
        elif code == 0x61:  # APPEND
            item = _pop(stack)[0]
            if stack and isinstance(stack[-1], list):
                stack[-1].append(item)
        elif code == 0x73:  # SETITEM
            _pop(stack, 2)
        elif code == 0x62 or code == 0x30:  # BUILD, POP
            _pop(stack)
        elif code == 0x8C:  # SHORT_BINUNICODE
            length = data[pos]
            push(str(_counted(data, pos + 1, length), "utf-8", "surrogatepass"))
            pos += 1 + length
        elif code == 0x93:  # STACK_GLOBAL
            module, attribute = _pop(stack, 2)
            push(Global(f"{module}.{attribute}"))
        elif code == 0x2E:  # STOP
            return pos
        elif code == 0x95:  # FRAME
            pos += 8
        elif code == 0x80:  # PROTO
            pos += 1
        else:
            pos = _rare(data, pos, code, stack, marks, memo, claimant, budget)


def _rare(
    data: bytes,
    pos: int,
    code: int,
    stack: list[Any],
    marks: list[int],
    memo: dict[int, Any],
    claimant: Claimant,
    budget: _Budget,
) -> int:
    """The opcodes no checkpoint has many of; the position past this one's argument."""
    op = _BY_CODE.get(code)
    if op is None:
        raise ValueError(f"at position {pos - 1}, opcode {bytes([code])!r} unknown")
    if code in _REFUSED:
        raise Refused(f"the pickle opcode {op.name} (nothing torch.save or DCP writes)")
    arg: Any = None
    if op.arg is not None:  # read as pickletools reads it (text lines, counted strings)
        stream = io.BytesIO(data)
        stream.seek(pos)
        arg = op.arg.reader(stream)
        pos = stream.tell()
    name = op.name
    if name in ("PUT", "GET"):
        if name == "PUT":
            memo[int(arg or 0)] = stack[-1] if stack else OPAQUE
        else:
            stack.append(memo.get(int(arg or 0), OPAQUE))
    elif name in ("GLOBAL", "INST"):
        module, _, attribute = str(arg).partition(" ")
        if name == "INST":
            args = tuple(_pop_mark(stack, marks))
            budget.spend(args)
            claimant.call(Global(f"{module}.{attribute}"), args)
            stack.append(OPAQUE)
        else:
            stack.append(Global(f"{module}.{attribute}"))
    elif name == "NEWOBJ_EX":
        callee, args, _ = _pop(stack, 3)
        budget.spend(args)
        stack.append(claimant.call(callee, args))
    elif name == "OBJ":
        items = _pop_mark(stack, marks)
        args = tuple(items[1:])
        budget.spend(args)
        stack.append(claimant.call(items[0], args) if items else OPAQUE)
    elif name == "PERSID":
        stack.append(claimant.storage(arg))
    elif name == "LIST":
        stack.append(_pop_mark(stack, marks))
    elif name in ("DICT", "FROZENSET"):
        _pop_mark(stack, marks)
        stack.append(OPAQUE)
    elif name == "POP_MARK":
        _pop_mark(stack, marks)
    elif name == "DUP":
        stack.append(stack[-1] if stack else OPAQUE)
    else:  # a constant: INT, LONG*, FLOAT, STRING*, BINSTRING*, BINBYTES*, UNICODE*...
        stack.append(arg)
    return pos
