"""MLPerf HPC CosmoFlow's TFRecord files, read without TensorFlow: the framing, its CRC-32C, tf.train.Example.

MLPerf's CosmoFlow benchmark (mlcommons/hpc, ``cosmoflow/prepare.py``) ships its data as
TFRecord files -- ``train/*.tfrecord`` and ``validation/*.tfrecord``, gzip-compressed in the
v1.0 release -- each holding one ``tf.train.Example`` per sample: ``x``, the (128, 128, 128, 4)
int16 particle counts of one sub-volume in C order (channels last) as raw bytes, and ``y``,
the 4 target parameters (unitPar) as floats.  ``refimpl convert`` turns them into refimpl's
HDF5 layout (docs/data.md); this module is the reading, in three layers:

**Framing** (TensorFlow's ``record_writer.cc``).  A file is a sequence of records, each::

    uint64 length (little-endian) | uint32 masked_crc(length bytes) | data | uint32 masked_crc(data)

with ``masked_crc(b) = rotate_right(crc32c(b), 15) + 0xA282EAD8`` (mod 2^32).  A file written
with compression "GZIP" is one gzip stream of those bytes (recognised by its magic 1f 8b).

**CRC-32C** (Castagnoli: the reflected polynomial 0x82F63B78, register initialised to and
finally xor-ed with 0xFFFFFFFF).  A byte at a time in Python a 16 MiB record would take
seconds, so ``crc32c`` runs in NumPy lanes.  The register update per byte,
``r -> T[(r ^ b) & 0xFF] ^ (r >> 8)``, is linear over GF(2) in (r, b), because the table T
is (T[a ^ b] = T[a] ^ T[b]).  Two consequences:

- four bytes at once: the register after the little-endian word w is ``shift_4(r ^ w)``,
  ``shift_4`` the register after 4 zero bytes, a linear map of 32 bits, so the xor of two
  (65536,) tables indexed by its low and high halves (``WORD_LOW``, ``WORD_HIGH``);
- pieces at once: the data, cut into K pieces of L bytes, is run through K registers side by
  side (L/4 NumPy steps over K lanes), each lane from 0 except the first (from the register
  so far); then, from the left, the register of the whole so far is carried across the next
  piece -- L zero bytes, the linear map ``shift_L`` applied by four byte tables -- and xor-ed
  with that piece's lane:  ``crc(A || B) = shift_len(B)(crc(A)) ^ crc_0(B)``.  What does not
  fill a piece is run the same way, and its last bytes (under ``MIN_LANE_BYTES``) one at a time.

**tf.train.Example** (``example.proto``, ``feature.proto``), in protobuf's wire format (each
field a varint key ``number << 3 | wire type``; wire types 0 varint, 1 8 bytes,
2 length-delimited, 5 4 bytes)::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }    // entries { string key = 1; Feature value = 2; }
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }   // packed (one length-delimited run) or not
    Int64List { repeated int64 value = 1 [packed = true]; }

Tested against files written by an independent writer (the ``tfrecord`` package: Google's
protobuf and the ``crc32c`` package), plain and gzip-compressed (tests/test_convert.py).
"""
from __future__ import annotations

import gzip
import struct

import numpy

#: CRC-32C's reflected polynomial, and the mask TFRecord adds to a rotated CRC.
POLYNOMIAL = 0x82F63B78
MASK_DELTA = 0xA282EAD8
#: At most this many lanes at once, each a piece of at least ``MIN_PIECE_BYTES`` (a multiple of 4);
#: data shorter than ``MIN_LANE_BYTES`` runs a byte at a time (building the lanes costs more).
#: Measured on 16 MiB: 4096 lanes 57 ms, 16384 lanes 34 ms, 65536 lanes 45 ms (the carry
#: across pieces is a Python loop over the lanes); a byte per step in 4096 lanes took 182 ms.
LANES = 16384
MIN_PIECE_BYTES = 1024
MIN_LANE_BYTES = 1 << 14
GZIP_MAGIC = b"\x1f\x8b"


def _byte_table():
    """T[i]: the register after one byte i from 0 (the reflected table, 8 shifts each)."""
    t = numpy.arange(256, dtype=numpy.uint32)
    for _ in range(8):
        t = numpy.where(t & 1, (t >> 1) ^ numpy.uint32(POLYNOMIAL), t >> 1).astype(numpy.uint32)
    return t


TABLE = _byte_table()
_PY_TABLE = [int(v) for v in TABLE]
_SHIFT_TABLES = {}


def _update_bytes(register: int, data) -> int:
    """The raw register (no initial or final xor) after ``data``, a byte at a time."""
    table = _PY_TABLE
    for b in bytes(data):
        register = table[(register ^ b) & 0xFF] ^ (register >> 8)
    return register


def _shift_tables(length: int):
    """Four (256,) tables whose xor over the register's bytes is the register after ``length``
    zero bytes: ``shift_length`` is linear, so its image of each of the 32 bit vectors (run as
    32 lanes) combines into the image of every byte value."""
    if length not in _SHIFT_TABLES:
        r = numpy.uint32(1) << numpy.arange(32, dtype=numpy.uint32)           # the 32 bit vectors
        for _ in range(length):
            r = TABLE[r & 0xFF] ^ (r >> 8)
        tables = numpy.zeros((4, 256), dtype=numpy.uint32)
        values = numpy.arange(256)
        for byte in range(4):
            for bit in range(8):
                tables[byte, (values >> bit) & 1 == 1] ^= r[8 * byte + bit]
        _SHIFT_TABLES[length] = [[int(v) for v in row] for row in tables]
    return _SHIFT_TABLES[length]


def _word_tables():
    """``(WORD_LOW, WORD_HIGH)``: ``shift_4`` (the register after 4 zero bytes) of every value
    of the register's low 16 bits and of its high 16 bits, from ``_shift_tables(4)``'s bytes."""
    t0, t1, t2, t3 = (numpy.array(t, dtype=numpy.uint32) for t in _shift_tables(4))
    half = numpy.arange(1 << 16)
    return t0[half & 0xFF] ^ t1[half >> 8], t2[half & 0xFF] ^ t3[half >> 8]


WORD_LOW, WORD_HIGH = _word_tables()


def _update(register: int, view) -> int:
    """The raw register after the bytes of ``view`` (uint8), from ``register``: in lanes of
    4-byte words where it is long (the module's doc), the rest again the same way."""
    n = view.size
    if n < MIN_LANE_BYTES:
        return _update_bytes(register, view)
    lanes = min(LANES, n // MIN_PIECE_BYTES)
    piece = (n // lanes) & ~3                            # bytes per lane, whole words
    # (piece / 4, lanes): step j holds word j of every piece, contiguous (and aligned) for the gathers
    words = numpy.ascontiguousarray(view[:lanes * piece].view("<u4").reshape(lanes, piece // 4).T)
    r = numpy.zeros(lanes, dtype=numpy.uint32)
    r[0] = register
    for word in words:                                   # every lane one word further
        x = r ^ word
        r = WORD_LOW[x & 0xFFFF] ^ WORD_HIGH[x >> 16]
    t0, t1, t2, t3 = _shift_tables(piece)
    register = int(r[0])
    for lane in r[1:].tolist():                          # carry the whole so far across each piece
        register = (t0[register & 0xFF] ^ t1[(register >> 8) & 0xFF] ^ t2[(register >> 16) & 0xFF]
                    ^ t3[register >> 24] ^ lane)
    return _update(register, view[lanes * piece:])


def crc32c(data) -> int:
    """CRC-32C of ``data`` (bytes-like): in NumPy lanes for long data (the module's doc)."""
    return _update(0xFFFFFFFF, numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)) ^ 0xFFFFFFFF


def masked_crc(data) -> int:
    """TFRecord's checksum of ``data``: CRC-32C rotated right by 15 bits, plus MASK_DELTA."""
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + MASK_DELTA) & 0xFFFFFFFF


def open_records(path):
    """The file's bytes as a binary stream: gunzipped where it starts with gzip's magic."""
    fh = open(path, "rb")                                # a BufferedReader: peek() reads ahead, consumes nothing
    if fh.peek(2)[:2] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=fh, mode="rb")
    return fh


def records(path, verify: bool = True):
    """The records of TFRecord file ``path`` (plain or gzip), each as bytes, in order;
    ``verify`` checks both CRCs of every record.  ValueError naming the file, the record and
    what is wrong: a truncated record, a CRC mismatch, a damaged gzip stream."""
    with open_records(path) as fh:
        index = 0
        while True:
            try:
                head = fh.read(12)
                if not head:
                    return
                where = f"{path}: record {index}"
                if len(head) < 12:
                    raise ValueError(f"{where}: truncated header ({len(head)} of 12 bytes)")
                length, length_crc = struct.unpack("<QI", head)
                if masked_crc(head[:8]) != length_crc:
                    raise ValueError(f"{where}: the length's CRC does not match (not a TFRecord file, "
                                     "or damaged)")
                data = fh.read(length)
                tail = fh.read(4)
            except (OSError, EOFError, gzip.BadGzipFile) as err:     # zlib's own CRC and length checks
                raise ValueError(f"{path}: record {index}: the gzip stream is damaged ({err})") from None
            if len(data) < length or len(tail) < 4:
                raise ValueError(f"{where}: truncated ({len(data)} of {length} data bytes)")
            if verify and masked_crc(data) != struct.unpack("<I", tail)[0]:
                raise ValueError(f"{where}: the data's CRC does not match (damaged)")
            yield data
            index += 1


# ---------------------------------------------------------------- protobuf: tf.train.Example

def _varint(buf, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at ``pos``."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("a varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def fields(buf):
    """``(number, wire type, value)`` of each field of a protobuf message: value an int
    (wire types 0, 1, 5: the raw bits) or a memoryview (2)."""
    buf = memoryview(buf)
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise ValueError("a fixed-width field runs past the end of its message")
            value = int.from_bytes(buf[pos:pos + size], "little")
            pos += size
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("a length-delimited field runs past the end of its message")
            value = buf[pos:pos + size]
            pos += size
        else:
            raise ValueError(f"wire type {wire} (groups) is not in tf.train.Example")
        yield number, wire, value


def _feature(buf):
    """One Feature: a list of bytes, a float32 array or an int64 array."""
    for number, wire, value in fields(buf):
        if wire != 2:
            continue
        if number == 1:                                      # BytesList
            return [bytes(v) for n, w, v in fields(value) if n == 1 and w == 2]
        if number == 2:                                      # FloatList: packed runs and single floats
            parts = []
            for n, w, v in fields(value):
                if n == 1 and w == 2:
                    if len(v) % 4:
                        raise ValueError("a packed float list whose length is not a multiple of 4")
                    parts.append(numpy.frombuffer(v, dtype="<f4"))
                elif n == 1 and w == 5:
                    parts.append(numpy.frombuffer(struct.pack("<I", v), dtype="<f4"))
            return numpy.concatenate(parts).astype(numpy.float32) if parts else numpy.zeros(0, numpy.float32)
        if number == 3:                                      # Int64List: packed varints or single ones
            out = []
            for n, w, v in fields(value):
                if n == 1 and w == 2:
                    pos = 0
                    while pos < len(v):
                        x, pos = _varint(v, pos)
                        out.append(x)
                elif n == 1 and w == 0:
                    out.append(v)
            return numpy.array([x - (1 << 64) if x >= 1 << 63 else x for x in out], dtype=numpy.int64)
    return []                                                # a Feature with no kind set


def parse_example(buf) -> dict:
    """The features of a serialized tf.train.Example: name -> list of bytes (BytesList),
    float32 array (FloatList) or int64 array (Int64List).  ValueError if it is not one."""
    out = {}
    for number, wire, value in fields(buf):
        if number != 1 or wire != 2:                         # Example.features
            continue
        for n, w, entry in fields(value):
            if n != 1 or w != 2:                             # Features.feature (map entries)
                continue
            key, feature = None, b""
            for n2, w2, v2 in fields(entry):
                if n2 == 1 and w2 == 2:
                    key = bytes(v2).decode("utf-8")
                elif n2 == 2 and w2 == 2:
                    feature = v2
            if key is None:
                raise ValueError("a feature map entry without a key")
            out[key] = _feature(feature)
    return out


# ---------------------------------------------------------------- MLPerf CosmoFlow's samples

#: The feature names and layout of MLPerf's CosmoFlow records (``prepare.py``, ``data/cosmo.py``).
DATA_FEATURE, TARGET_FEATURE, CHANNELS, TARGETS = "x", "y", 4, 4


def mlperf_sample(record: bytes, where: str):
    """``(full (4, S, S, S) float32 counts, unitPar (4,) float32)`` of one MLPerf CosmoFlow
    record: ``x`` is (S, S, S, 4) int16 in C order (channels last), moved to channels first
    (refimpl's (C, D, H, W), D the first axis); ``y`` the 4 targets.  ValueError naming
    ``where`` for any other content."""
    try:
        features = parse_example(record)
    except ValueError as err:
        raise ValueError(f"{where}: not a tf.train.Example ({err})") from None
    missing = [k for k in (DATA_FEATURE, TARGET_FEATURE) if k not in features]
    if missing:
        raise ValueError(f"{where}: no feature {', '.join(map(repr, missing))} (MLPerf CosmoFlow's records hold "
                         f"'x' and 'y'); found {sorted(features)}")
    x, y = features[DATA_FEATURE], features[TARGET_FEATURE]
    if not isinstance(x, list) or len(x) != 1:
        raise ValueError(f"{where}: feature 'x' must be one bytes value (int16 counts), got "
                         f"{type(x).__name__} of {len(x)}")
    if not isinstance(y, numpy.ndarray) or y.dtype != numpy.float32 or y.size != TARGETS:
        raise ValueError(f"{where}: feature 'y' must be {TARGETS} floats, got "
                         f"{getattr(y, 'dtype', type(y).__name__)} of {len(y)}")
    voxels, odd = divmod(len(x[0]), 2 * CHANNELS)
    size = round(voxels ** (1 / 3)) if voxels else 0
    if odd or size < 1 or size ** 3 != voxels:
        raise ValueError(f"{where}: feature 'x' holds {len(x[0])} bytes, not S^3 x {CHANNELS} int16 values "
                         "of a cube")
    counts = numpy.frombuffer(x[0], dtype="<i2").reshape(size, size, size, CHANNELS)
    full = numpy.ascontiguousarray(counts.transpose(3, 0, 1, 2), dtype=numpy.float32)   # (C, D, H, W)
    if not numpy.isfinite(y).all():
        raise ValueError(f"{where}: feature 'y' holds a NaN or infinity")
    return full, y.copy()


__all__ = ["crc32c", "masked_crc", "records", "parse_example", "fields", "mlperf_sample", "open_records"]
