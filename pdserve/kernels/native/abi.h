/* Why: each struct that Python passes to a kernel is declared once in Python
 * (kernels/native/abi.py) and, when the library loads, compared with the layout the
 * compiler gives it here, field by field. A field added, moved or resized on one side
 * only then refuses to load, naming the struct and the field, instead of the kernel
 * reading the wrong bytes.
 *
 * A library whose structs Python mirrors ends with a table of them:
 *
 *     static const PdAbiField abi[] = {
 *         PD_ABI_STRUCT(Args), PD_ABI_FIELD(Args, x), PD_ABI_FIELD(Args, n), PD_ABI_END,
 *     };
 *     PD_ABI_EXPORT(abi)
 *
 * Every member of a listed struct is listed (tests/test_native_abi.py reads the struct
 * definitions and checks it).
 */
#ifndef PD_ABI_H
#define PD_ABI_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *type;  /* the struct's typedef name; NULL ends the table */
    const char *field; /* "" for the struct itself */
    int64_t offset, size;
} PdAbiField;

#define PD_ABI_STRUCT(T) {#T, "", 0, (int64_t)sizeof(T)}
#define PD_ABI_FIELD(T, f) {#T, #f, (int64_t)offsetof(T, f), (int64_t)sizeof(((T *)0)->f)}
#define PD_ABI_END {NULL, NULL, 0, 0}
/* the one symbol abi.py reads: the table's first entry */
#define PD_ABI_EXPORT(table) \
    const PdAbiField *pd_abi_layout(void) { return table; }

#endif
