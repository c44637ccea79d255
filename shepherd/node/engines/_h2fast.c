/* A paced engine's read in C: ``H2Connection.receive`` of bytes that are whole DATA frames of one stream, each
 * without flags and holding exactly one whole uncompressed gRPC message (what ``receive`` hands to
 * ``_grpc_run``). ``grpc_data(conn, data, max_frame)`` checks everything first and changes nothing unless it
 * takes the whole read: the connection not failed, no buffered bytes, no header block in progress, the
 * server's SETTINGS received, the stream open with a message sink, and both receive windows' unacknowledged
 * counts staying below the credit threshold (a WINDOW_UPDATE to send is ``receive``'s). Then it does what
 * ``receive`` and ``_grpc_run`` do: the counts grow by the frames' payload, the messages (prefix stripped) go
 * to the sink, and ``on_grpc_messages`` follows. True when it took the read; False (nothing changed) sends
 * the read through ``receive``'s Python frame loop. The property tests compare the two on any frames. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *s_failed, *s_rbuf, *s_cont, *s_settings_received, *s_streams, *s_conn_recv_unacked,
    *s_credit_threshold, *s_grpc_messages, *s_recv_unacked, *s_append, *s_on_grpc_messages;

/* an exact int's value when it fits an int64 and is >= 0, else -1 (no error set) */
static int64_t nonneg(PyObject *o) {
    if (o == NULL || !PyLong_CheckExact(o)) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    if (overflow || v < 0) return -1;
    return (int64_t)v;
}

#define MAX_RUN 64 /* frames taken in one read (a paced engine sends 1) */

static PyObject *grpc_data(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3 || !PyBytes_CheckExact(args[1])) Py_RETURN_FALSE;
    PyObject *conn = args[0], *data = args[1];
    int64_t max_frame = nonneg(args[2]);
    if (max_frame < 0) Py_RETURN_FALSE;
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    /* -- the frames: whole, DATA, no flags, one stream (reserved bit clear), one whole message each */
    Py_ssize_t starts[MAX_RUN], lens[MAX_RUN];
    int frames = 0;
    uint32_t sid = 0;
    int64_t total = 0;
    Py_ssize_t off = 0;
    while (off < n) {
        if (frames == MAX_RUN || n - off < 14) Py_RETURN_FALSE;
        const uint8_t *h = b + off;
        Py_ssize_t length = ((Py_ssize_t)h[0] << 16) | ((Py_ssize_t)h[1] << 8) | h[2];
        uint32_t fsid = ((uint32_t)h[5] << 24) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 8) | h[8];
        uint32_t mlen = ((uint32_t)h[10] << 24) | ((uint32_t)h[11] << 16) | ((uint32_t)h[12] << 8) | h[13];
        if (h[3] != 0 || h[4] != 0 || fsid == 0 || (fsid & 0x80000000u) || h[9] != 0 || length > max_frame ||
            length < 5 || (int64_t)mlen + 5 != (int64_t)length || length > n - off - 9)
            Py_RETURN_FALSE;
        if (frames == 0)
            sid = fsid;
        else if (fsid != sid)
            Py_RETURN_FALSE;
        starts[frames] = off + 14;
        lens[frames] = length - 5;
        frames++;
        total += length;
        off += 9 + length;
    }
    if (frames == 0) Py_RETURN_FALSE;
    /* -- the connection's and the stream's state (read: nothing is changed unless all of it fits) */
    PyObject *failed = NULL, *rbuf = NULL, *cont = NULL, *settings = NULL, *streams = NULL, *cru = NULL,
             *thr = NULL, *key = NULL, *s = NULL, *sink = NULL, *sru = NULL, *v = NULL, *result = NULL;
    if ((failed = PyObject_GetAttr(conn, s_failed)) == NULL) goto error;
    if ((rbuf = PyObject_GetAttr(conn, s_rbuf)) == NULL) goto error;
    if ((cont = PyObject_GetAttr(conn, s_cont)) == NULL) goto error;
    if ((settings = PyObject_GetAttr(conn, s_settings_received)) == NULL) goto error;
    if ((streams = PyObject_GetAttr(conn, s_streams)) == NULL) goto error;
    if ((cru = PyObject_GetAttr(conn, s_conn_recv_unacked)) == NULL) goto error;
    if ((thr = PyObject_GetAttr(conn, s_credit_threshold)) == NULL) goto error;
    if (failed != Py_None || !PyBytes_CheckExact(rbuf) || PyBytes_GET_SIZE(rbuf) != 0 || cont != Py_None ||
        settings != Py_True || !PyDict_CheckExact(streams))
        goto theirs;
    int64_t conn_unacked = nonneg(cru), threshold = nonneg(thr);
    /* (compared as unacked >= threshold - total: the sum could overflow an int64 on hostile counts) */
    if (conn_unacked < 0 || threshold < 0 || conn_unacked >= threshold - total) goto theirs;
    if ((key = PyLong_FromUnsignedLong(sid)) == NULL) goto error;
    s = PyDict_GetItemWithError(streams, key); /* borrowed (an exact dict of int keys: no Python code) */
    if (s == NULL) {
        if (PyErr_Occurred()) goto error;
        goto theirs;
    }
    Py_INCREF(s);
    if ((sink = PyObject_GetAttr(s, s_grpc_messages)) == NULL) goto error;
    if ((sru = PyObject_GetAttr(s, s_recv_unacked)) == NULL) goto error;
    if (sink == Py_None) goto theirs;
    int64_t stream_unacked = nonneg(sru);
    if (stream_unacked < 0 || stream_unacked >= threshold - total) goto theirs;
    /* -- taken: the counts, the messages, the stream's callback (receive's and _grpc_run's writes) */
    if ((v = PyLong_FromLongLong((long long)(conn_unacked + total))) == NULL) goto error;
    if (PyObject_SetAttr(conn, s_conn_recv_unacked, v) < 0) goto error;
    Py_CLEAR(v);
    if ((v = PyLong_FromLongLong((long long)(stream_unacked + total))) == NULL) goto error;
    if (PyObject_SetAttr(s, s_recv_unacked, v) < 0) goto error;
    Py_CLEAR(v);
    for (int i = 0; i < frames; i++) {
        PyObject *msg = PyBytes_FromStringAndSize((const char *)b + starts[i], lens[i]);
        if (msg == NULL) goto error;
        PyObject *r = PyObject_CallMethodOneArg(sink, s_append, msg);
        Py_DECREF(msg);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    {
        PyObject *r = PyObject_CallMethodNoArgs(s, s_on_grpc_messages);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    result = Py_True;
    Py_INCREF(result);
    goto done;
theirs:
    result = Py_False;
    Py_INCREF(result);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(failed);
    Py_XDECREF(rbuf);
    Py_XDECREF(cont);
    Py_XDECREF(settings);
    Py_XDECREF(streams);
    Py_XDECREF(cru);
    Py_XDECREF(thr);
    Py_XDECREF(key);
    Py_XDECREF(s);
    Py_XDECREF(sink);
    Py_XDECREF(sru);
    Py_XDECREF(v);
    return result;
}

static PyMethodDef methods[] = {
    {"grpc_data", (PyCFunction)(void (*)(void))grpc_data, METH_FASTCALL,
     "grpc_data(conn, data, max_frame) -> bool: receive() of whole plain gRPC DATA frames of one stream, "
     "taken in C (False: nothing changed, receive's)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_h2fast",
    "A paced engine's read (whole plain gRPC DATA frames of one stream) in C.", -1, methods, NULL, NULL, NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__h2fast(void) {
    struct {
        PyObject **p;
        const char *s;
    } names[] = {{&s_failed, "failed"},
                 {&s_rbuf, "_rbuf"},
                 {&s_cont, "_cont"},
                 {&s_settings_received, "settings_received"},
                 {&s_streams, "streams"},
                 {&s_conn_recv_unacked, "conn_recv_unacked"},
                 {&s_credit_threshold, "_credit_threshold"},
                 {&s_grpc_messages, "grpc_messages"},
                 {&s_recv_unacked, "recv_unacked"},
                 {&s_append, "append"},
                 {&s_on_grpc_messages, "on_grpc_messages"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL) return NULL;
    }
    return PyModule_Create(&module_def);
}
