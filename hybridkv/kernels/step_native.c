/* The step buffers' native functions as a CPython extension module, `hybridkv_step_native` (step_buffers.py):
   built with step_fill.c against the running Python's headers, imported, and called like Python functions. A
   ctypes call converts each argument through Python code and costs microseconds more once a forward has evicted
   its code, and a decode step makes two such calls.

   `decode_inputs` reads a decode step's Python lists and writes them into the step buffers in one call. In Python
   the same work is four `array`s, a list comprehension, a dict lookup per sequence and four buffer assignments:
   each costs microseconds once a forward has evicted its code, where this loop over a few dozen items costs one or
   two. Sequence s of the step (one new token each, `seq_lens[s]` tokens with it) gets ids[s] = input_ids[s],
   positions[s] = seq_lens[s] - 1, lengths[s] = seq_lens[s] (int32) and rows[s] = row_of[request_ids[s]], its row
   of the persistent batch; wanted[i] = logits_rows[i] for each logits row. Returns the longest sequence, or raises:
   lists of other lengths than seq_lens' (ValueError), more sequences or logits rows than `capacity` (ValueError),
   a value that is not an int or does not fit its buffer (TypeError, OverflowError), a sequence length below 1
   (ValueError), a request without a row (KeyError). Nothing is read past a list's end.

   `step_fill` is step_fill.c's `hybridkv_step_fill`, its arguments in the same order (addresses as ints). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* An int of an object, held while it is read: a non-int's __index__ (or a key's __hash__) may run Python code, which
   may change the list or dict it came from (hence PyList_GetItem, which checks the index, too). */
static int read_held(PyObject *object, long long *value) {
    Py_INCREF(object);
    *value = PyLong_AsLongLong(object);
    Py_DECREF(object);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
}

static int read_int(PyObject *list, Py_ssize_t index, long long *value) {
    PyObject *item = PyList_GetItem(list, index); /* borrowed */
    return item == NULL ? -1 : read_held(item, value);
}

static int check_list(PyObject *object, const char *name, Py_ssize_t length) {
    if (!PyList_Check(object)) {
        PyErr_Format(PyExc_TypeError, "a decode step's %s must be a list", name);
        return -1;
    }
    if (length >= 0 && PyList_GET_SIZE(object) != length) {
        PyErr_Format(PyExc_ValueError, "a decode step of %zd sequences has %zd %s", length, PyList_GET_SIZE(object),
                     name);
        return -1;
    }
    return 0;
}

static long long decode_inputs(PyObject *input_ids, PyObject *seq_lens, PyObject *request_ids, PyObject *row_of,
                               PyObject *logits_rows, int64_t *ids, int64_t *positions, int32_t *lengths,
                               int64_t *rows, int64_t *wanted, int64_t capacity) {
    if (check_list(seq_lens, "sequence lengths", -1)) return -1;
    Py_ssize_t num_seqs = PyList_GET_SIZE(seq_lens);
    if (check_list(input_ids, "token ids", num_seqs) || check_list(request_ids, "request ids", num_seqs) ||
        check_list(logits_rows, "logits rows", -1))
        return -1;
    if (!PyDict_Check(row_of)) {
        PyErr_SetString(PyExc_TypeError, "a decode step's rows must be a dict of request id to row");
        return -1;
    }
    Py_ssize_t num_wanted = PyList_GET_SIZE(logits_rows);
    if (num_seqs > capacity || num_wanted > capacity) {
        PyErr_Format(PyExc_ValueError, "a decode step of %zd sequences and %zd logits rows is larger than the buffers "
                     "(%lld)", num_seqs, num_wanted, (long long)capacity);
        return -1;
    }
    long long longest = 0, value;
    for (Py_ssize_t s = 0; s < num_seqs; s++) {
        if (read_int(seq_lens, s, &value)) return -1;
        if (value < 1 || value > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "sequence %zd of a decode step holds %lld tokens", s, value);
            return -1;
        }
        lengths[s] = (int32_t)value;
        positions[s] = value - 1;
        if (value > longest) longest = value;
        if (read_int(input_ids, s, &value)) return -1;
        ids[s] = value;
        PyObject *request_id = PyList_GetItem(request_ids, s); /* borrowed, as is the dict's item */
        if (request_id == NULL) return -1;
        Py_INCREF(request_id);
        PyObject *row = PyDict_GetItemWithError(row_of, request_id);
        if (row == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, request_id);
        Py_DECREF(request_id);
        if (row == NULL || read_held(row, &value)) return -1;
        rows[s] = value;
    }
    for (Py_ssize_t i = 0; i < num_wanted; i++) {
        if (read_int(logits_rows, i, &value)) return -1;
        wanted[i] = value;
    }
    return longest;
}

int hybridkv_step_fill(const int32_t *groups, int64_t num_groups, int64_t num_rows, int64_t row_stride,
                       const int64_t *rows, const int64_t *query_lens, int64_t num_seqs, const int64_t *positions,
                       int64_t block_size, int64_t block_width, int64_t *slots, int64_t slots_group_stride,
                       int32_t *tables, int64_t tables_group_stride, int64_t tables_row_stride);

/* Integer arguments 0..count-1 of a fast call, into `values`: -1 with an exception set where one is no int. */
static int int_arguments(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t first, Py_ssize_t count,
                         const char *name, long long *values) {
    if (nargs != first + count) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, not %zd", name, first + count, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (read_held(args[first + i], &values[i])) return -1;
    return 0;
}

static PyObject *py_decode_inputs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long v[6];
    if (int_arguments(args, nargs, 5, 6, "decode_inputs", v)) return NULL;
    long long longest = decode_inputs(args[0], args[1], args[2], args[3], args[4], (int64_t *)(intptr_t)v[0],
                                      (int64_t *)(intptr_t)v[1], (int32_t *)(intptr_t)v[2], (int64_t *)(intptr_t)v[3],
                                      (int64_t *)(intptr_t)v[4], v[5]);
    return longest < 0 ? NULL : PyLong_FromLongLong(longest);
}

static PyObject *py_step_fill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    long long v[15];
    if (int_arguments(args, nargs, 0, 15, "step_fill", v)) return NULL;
    int status = hybridkv_step_fill((const int32_t *)(intptr_t)v[0], v[1], v[2], v[3], (const int64_t *)(intptr_t)v[4],
                                    (const int64_t *)(intptr_t)v[5], v[6], (const int64_t *)(intptr_t)v[7], v[8], v[9],
                                    (int64_t *)(intptr_t)v[10], v[11], (int32_t *)(intptr_t)v[12], v[13], v[14]);
    return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"decode_inputs", (PyCFunction)(void (*)(void))py_decode_inputs, METH_FASTCALL,
     "decode_inputs(input_ids, seq_lens, request_ids, row_of, logits_rows, ids_at, positions_at, lengths_at, "
     "rows_at, wanted_at, capacity) -> the longest sequence"},
    {"step_fill", (PyCFunction)(void (*)(void))py_step_fill, METH_FASTCALL,
     "step_fill(...): step_fill.c's hybridkv_step_fill, addresses as ints -> 0, or 1 for a row or position outside "
     "the tables"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "hybridkv_step_native", NULL, 0, methods};

PyMODINIT_FUNC PyInit_hybridkv_step_native(void) { return PyModule_Create(&module); }
