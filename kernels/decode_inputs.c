/* A decode step's inputs, read from the model runner's Python lists and written into the step buffers in one call
   (step_buffers.py, `StepBuffers.decode_step`).

   Built against the running Python's headers and called through ctypes.PyDLL (the GIL held). In Python the same
   work is four `array`s, a list comprehension, a dict lookup per sequence and four buffer assignments: each costs
   microseconds once a forward has evicted its code, where this loop over a few dozen items costs one or two.

   Sequence s of the step (one new token each, `seq_lens[s]` tokens with it) gets ids[s] = input_ids[s],
   positions[s] = seq_lens[s] - 1, lengths[s] = seq_lens[s] (int32) and rows[s] = row_of[request_ids[s]], its row
   of the persistent batch; wanted[i] = logits_rows[i] for each logits row. Returns the longest sequence, or -1
   with a Python exception set: lists of other lengths than seq_lens' (ValueError), more sequences or logits rows
   than `capacity` (ValueError), a value that is not an int or does not fit its buffer (TypeError, OverflowError),
   a sequence length below 1 (ValueError), a request without a row (KeyError). Nothing is read past a list's end. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* PyList_GetItem checks the index: an item's __index__ may run Python code, which may shorten a list. */
static int read_int(PyObject *list, Py_ssize_t index, long long *value) {
    PyObject *item = PyList_GetItem(list, index); /* borrowed */
    if (item == NULL) return -1;
    *value = PyLong_AsLongLong(item);
    return *value == -1 && PyErr_Occurred() ? -1 : 0;
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

long long hybridkv_decode_inputs(PyObject *input_ids, PyObject *seq_lens, PyObject *request_ids, PyObject *row_of,
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
        PyObject *request_id = PyList_GetItem(request_ids, s); /* borrowed, as are the dict's items */
        if (request_id == NULL) return -1;
        PyObject *row = PyDict_GetItemWithError(row_of, request_id);
        if (row == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, request_id);
            return -1;
        }
        value = PyLong_AsLongLong(row);
        if (value == -1 && PyErr_Occurred()) return -1;
        rows[s] = value;
    }
    for (Py_ssize_t i = 0; i < num_wanted; i++) {
        if (read_int(logits_rows, i, &value)) return -1;
        wanted[i] = value;
    }
    return longest;
}
