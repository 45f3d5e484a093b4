/* Protobuf wire format for many messages of one shape (viewer/export/wire.py), called
 * through ctypes, which releases the GIL.
 *
 * numpy encodes a message column by column: a pass over every message per byte of every
 * varint, and a fancy-index scatter per piece, so a probe row's two packets cost about a
 * microsecond (10 M probe rows: 26 s of the 52 s export). Here each message is written
 * in one go, piece after piece, into its place in the buffer: the bytes are the same.
 *
 * No Python API is used: the module init only exists so setuptools can build this as an
 * extension and pip can install it like one.
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* One piece of every message: the layout of wire.py's `_Piece` ctypes structure. */
typedef struct {
    int64_t kind;             /* 0: the same bytes in every message; 1: a varint each; 2: bytes each;
                                 3 (sizes only): a submessage, its tag then its size then that many bytes */
    int64_t nbytes;           /* kind 0: how many bytes; kind 3: the tag's */
    const uint8_t *bytes;     /* kind 0: the bytes; kind 2: every message's, back to back */
    const uint64_t *values;   /* kind 1: one value per message; kind 3: each submessage's size */
    const int64_t *lengths;   /* kind 2: each message's byte count */
} piece;

static inline int64_t varint_size(uint64_t v) {
    return (64 - __builtin_clzll(v | 1) + 6) / 7;
}

/* out[i] += the encoded size of message i. */
void wire_sizes(int64_t n, int64_t np, const piece *p, int64_t *out) {
    for (int64_t k = 0; k < np; k++) {
        const piece *q = &p[k];
        if (q->kind == 0) {
            for (int64_t i = 0; i < n; i++) out[i] += q->nbytes;
        } else if (q->kind == 1) {
            for (int64_t i = 0; i < n; i++) out[i] += varint_size(q->values[i]);
        } else if (q->kind == 3) {
            for (int64_t i = 0; i < n; i++) out[i] += q->nbytes + varint_size(q->values[i]) + (int64_t)q->values[i];
        } else {
            for (int64_t i = 0; i < n; i++) out[i] += q->lengths[i];
        }
    }
}

/* Message i at buf + start[i]; start holds room for each (wire_sizes). Kinds 0-2 only:
 * wire.py spells a submessage out as its tag, its size and its pieces. */
void wire_write(int64_t n, int64_t np, const piece *p, const int64_t *start, uint8_t *buf) {
    int64_t cursor[np > 0 ? np : 1]; /* each kind-2 piece's next byte in its data */
    for (int64_t k = 0; k < np; k++) cursor[k] = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *o = buf + start[i];
        for (int64_t k = 0; k < np; k++) {
            const piece *q = &p[k];
            if (q->kind == 0) {
                for (int64_t j = 0; j < q->nbytes; j++) *o++ = q->bytes[j]; /* a tag: 1-2 bytes, no call */
            } else if (q->kind == 1) {
                uint64_t v = q->values[i];
                while (v >= 0x80) {
                    *o++ = (uint8_t)(v | 0x80); /* continuation bit: more bytes follow */
                    v >>= 7;
                }
                *o++ = (uint8_t)v;
            } else {
                int64_t len = q->lengths[i];
                const uint8_t *from = q->bytes + cursor[k];
                if (len <= 16) {
                    for (int64_t j = 0; j < len; j++) o[j] = from[j];
                } else {
                    memcpy(o, from, (size_t)len);
                }
                cursor[k] += len;
                o += len;
            }
        }
    }
}

/* The messages of buf in `order`, back to back into out. */
void wire_gather(const uint8_t *buf, const int64_t *start, const int64_t *size, const int64_t *order,
                 int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t j = order[i];
        memcpy(out, buf + start[j], (size_t)size[j]);
        out += size[j];
    }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
