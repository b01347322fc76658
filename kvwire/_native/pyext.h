/* What every C extension's Python glue does alike: check a METH_FASTCALL method's
 * argument count, hand out 64-bit ints as a list, and make the module with its types and
 * int constants. Include after Python.h. */
#ifndef KVWIRE_PYEXT_H
#define KVWIRE_PYEXT_H

#include <stdint.h>
#include <string.h>

/* 0 when a METH_FASTCALL method got its `want` arguments; else -1 with TypeError. */
static inline int kvw_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
    return -1;
}

/* n unsigned 64-bit ints as a new list, or NULL with an error set. */
static inline PyObject *kvw_u64_list(const uint64_t *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
        if (!x) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* A 64-bit value as a new int: its bits as signed when neg, else unsigned. */
static inline PyObject *kvw_int(uint64_t v, int neg) {
    return neg ? PyLong_FromLongLong((long long)v) : PyLong_FromUnsignedLongLong(v);
}

typedef struct {
    const char *name;
    long value;
} KvwConst;

/* The module `def`, with each of `types` (NULL-ended) readied and added under its name
 * (tp_name after the last dot), and each of `consts` (name NULL-ended, or NULL); or NULL
 * with an error set. */
static inline PyObject *kvw_module(PyModuleDef *def, PyTypeObject *const *types,
                                   const KvwConst *consts) {
    for (PyTypeObject *const *t = types; *t; t++)
        if (PyType_Ready(*t) < 0) return NULL;
    PyObject *m = PyModule_Create(def);
    for (PyTypeObject *const *t = types; m && *t; t++)
        if (PyModule_AddObjectRef(m, strrchr((*t)->tp_name, '.') + 1, (PyObject *)*t) < 0)
            Py_CLEAR(m);
    for (const KvwConst *c = consts; m && c && c->name; c++)
        if (PyModule_AddIntConstant(m, c->name, c->value) < 0) Py_CLEAR(m);
    return m;
}

#endif /* KVWIRE_PYEXT_H */
