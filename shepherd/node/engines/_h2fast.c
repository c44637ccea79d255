/* A paced engine's reads in C: ``H2Connection.receive``'s frame loop over runs of DATA frames, each frame
 * without flags and holding exactly one whole uncompressed gRPC message (what ``receive`` hands to
 * ``_grpc_run``), of one stream a run and of any streams run after run (an engine that batches its decode
 * steps writes a token of many streams at once). ``grpc_data(conn, data, off, max_frame)`` takes the runs
 * from ``data[off]`` on and returns the offset of the first frame it did not take (``off``: none). Before
 * each run it checks everything and changes nothing unless it takes the run: the connection not failed, no
 * buffered bytes, no header block in progress, the server's SETTINGS received, the stream open with a
 * message sink, and both receive windows' unacknowledged counts staying below the credit threshold (a
 * WINDOW_UPDATE to send is ``receive``'s). Then it does what ``receive`` and ``_grpc_run`` do: the counts
 * grow by the run's payload, the messages (prefix stripped) go to the sink, and the stream's
 * ``on_grpc_messages`` follows (which may close streams or fail the connection: the next run is checked
 * after it; for a ``GrpcStream``, registered by ``direct_stream``, done here: its listener called). The
 * rest of the read, from the offset returned, is the Python frame loop's. The property tests compare the
 * two on any frames. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *s_failed, *s_rbuf, *s_cont, *s_settings_received, *s_streams, *s_conn_recv_unacked,
    *s_credit_threshold, *s_grpc_messages, *s_recv_unacked, *s_append, *s_on_grpc_messages, *s_waiter,
    *s_listener;

/* ``GrpcStream`` (``direct_stream``): a stream of exactly this type has its ``on_grpc_messages`` done here,
 * as it is written (no waiter: its ``listener`` called, when set), without the method's Python frame: a
 * paced engine's every token goes through it. Held for the process's life. */
static PyObject *direct_type = NULL;

/* what ``s.on_grpc_messages()`` does; 0, or -1 with an exception */
static int on_grpc_messages(PyObject *s) {
    PyObject *r;
    if (direct_type != NULL && (PyObject *)Py_TYPE(s) == direct_type) {
        PyObject *w = PyObject_GetAttr(s, s_waiter);
        if (w == NULL) return -1;
        int waiting = w != Py_None;
        Py_DECREF(w);
        if (!waiting) { /* (with a waiter: the method, which wakes it) */
            PyObject *listener = PyObject_GetAttr(s, s_listener);
            if (listener == NULL) return -1;
            if (listener == Py_None) {
                Py_DECREF(listener);
                return 0;
            }
            r = PyObject_CallNoArgs(listener);
            Py_DECREF(listener);
            if (r == NULL) return -1;
            Py_DECREF(r);
            return 0;
        }
    }
    r = PyObject_CallMethodNoArgs(s, s_on_grpc_messages);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* an exact int's value when it fits an int64 and is >= 0, else -1 (no error set) */
static int64_t nonneg(PyObject *o) {
    if (o == NULL || !PyLong_CheckExact(o)) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) PyErr_Clear();
    if (overflow || v < 0) return -1;
    return (int64_t)v;
}

/* the next run of ``data[off:]``: whole DATA frames of one stream, each without flags and holding exactly one
 * whole uncompressed gRPC message (a paced engine's tokens). Sets its stream id, frame count and payload
 * bytes; returns the offset after it (``off``: none, the frame there is not one of those) */
static Py_ssize_t next_run(const uint8_t *b, Py_ssize_t n, Py_ssize_t off, int64_t max_frame, uint32_t *sid,
                           Py_ssize_t *frames, int64_t *payload) {
    *frames = 0;
    *payload = 0;
    while (n - off >= 14) { /* bounded by the data */
        const uint8_t *h = b + off;
        Py_ssize_t length = ((Py_ssize_t)h[0] << 16) | ((Py_ssize_t)h[1] << 8) | h[2];
        uint32_t fsid = ((uint32_t)h[5] << 24) | ((uint32_t)h[6] << 16) | ((uint32_t)h[7] << 8) | h[8];
        uint32_t mlen = ((uint32_t)h[10] << 24) | ((uint32_t)h[11] << 16) | ((uint32_t)h[12] << 8) | h[13];
        if (h[3] != 0 || h[4] != 0 || fsid == 0 || (fsid & 0x80000000u) || h[9] != 0 || length > max_frame ||
            length < 5 || (int64_t)mlen + 5 != (int64_t)length || length > n - off - 9)
            break;
        if (*frames == 0)
            *sid = fsid;
        else if (fsid != *sid)
            break;
        (*frames)++;
        *payload += length;
        off += 9 + length;
    }
    return off;
}

/* grpc_data(conn, data, off, max_frame) -> int: see the module doc */
static PyObject *grpc_data(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 4) return PyLong_FromLong(0);
    PyObject *conn = args[0], *data = args[1];
    int64_t off0 = nonneg(args[2]), max_frame = nonneg(args[3]);
    /* a read that is not bytes (a bytearray, a memoryview) is the frame loop's: none taken, the offset given
     * (0 from the middle of a read would send receive's loop back to its start for ever) */
    if (!PyBytes_CheckExact(data)) return PyLong_FromLongLong(off0 < 0 ? 0 : (long long)off0);
    const uint8_t *b = (const uint8_t *)PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (off0 < 0 || max_frame < 0 || off0 > n) return PyLong_FromLong(0);
    Py_ssize_t off = (Py_ssize_t)off0;
    PyObject *failed = NULL, *rbuf = NULL, *cont = NULL, *settings = NULL, *streams = NULL, *cru = NULL,
             *thr = NULL, *key = NULL, *s = NULL, *sink = NULL, *sru = NULL, *v = NULL, *result;
    int64_t threshold;
    uint32_t sid = 0;
    Py_ssize_t frames;
    int64_t total;
    Py_ssize_t end = next_run(b, n, off, max_frame, &sid, &frames, &total);
    if (frames == 0) return PyLong_FromSsize_t(off); /* (a frame split over reads, another kind: no lookup) */
    /* -- what no callback changes: the server's SETTINGS seen, the stream table, the credit threshold */
    if ((settings = PyObject_GetAttr(conn, s_settings_received)) == NULL) goto error;
    if ((streams = PyObject_GetAttr(conn, s_streams)) == NULL) goto error;
    if ((thr = PyObject_GetAttr(conn, s_credit_threshold)) == NULL) goto error;
    threshold = nonneg(thr);
    if (settings != Py_True || !PyDict_CheckExact(streams) || threshold < 0) goto done;
    for (;;) { /* a run a turn: bounded by the data (each turn takes at least one frame or ends) */
        /* the connection's state, read again each run: a stream's callback may have failed it */
        Py_CLEAR(failed);
        Py_CLEAR(rbuf);
        Py_CLEAR(cont);
        Py_CLEAR(cru);
        if ((failed = PyObject_GetAttr(conn, s_failed)) == NULL) goto error;
        if ((rbuf = PyObject_GetAttr(conn, s_rbuf)) == NULL) goto error;
        if ((cont = PyObject_GetAttr(conn, s_cont)) == NULL) goto error;
        if ((cru = PyObject_GetAttr(conn, s_conn_recv_unacked)) == NULL) goto error;
        if (failed != Py_None || !PyBytes_CheckExact(rbuf) || PyBytes_GET_SIZE(rbuf) != 0 || cont != Py_None)
            goto done;
        int64_t conn_unacked = nonneg(cru);
        /* (compared as unacked >= threshold - total: the sum could overflow an int64 on hostile counts) */
        if (conn_unacked < 0 || conn_unacked >= threshold - total) goto done; /* a WINDOW_UPDATE: receive's */
        Py_CLEAR(key);
        Py_CLEAR(s);
        Py_CLEAR(sink);
        Py_CLEAR(sru);
        if ((key = PyLong_FromUnsignedLong(sid)) == NULL) goto error;
        /* borrowed, held at once (a key of equal hash compares in Python code, which may change the table:
         * the lookup then starts again; nothing else runs before the INCREF) */
        s = PyDict_GetItemWithError(streams, key);
        if (s == NULL) {
            if (PyErr_Occurred()) goto error;
            goto done; /* a closed stream's frames: receive's */
        }
        Py_INCREF(s);
        if ((sink = PyObject_GetAttr(s, s_grpc_messages)) == NULL) goto error;
        if ((sru = PyObject_GetAttr(s, s_recv_unacked)) == NULL) goto error;
        if (sink == Py_None) goto done;
        int64_t stream_unacked = nonneg(sru);
        if (stream_unacked < 0 || stream_unacked >= threshold - total) goto done;
        /* -- taken: the counts, the messages, the stream's callback (receive's and _grpc_run's writes) */
        if ((v = PyLong_FromLongLong((long long)(conn_unacked + total))) == NULL) goto error;
        if (PyObject_SetAttr(conn, s_conn_recv_unacked, v) < 0) goto error;
        Py_CLEAR(v);
        if ((v = PyLong_FromLongLong((long long)(stream_unacked + total))) == NULL) goto error;
        if (PyObject_SetAttr(s, s_recv_unacked, v) < 0) goto error;
        Py_CLEAR(v);
        for (Py_ssize_t at = off; at < end;) { /* the run's frames, checked by next_run */
            Py_ssize_t length = ((Py_ssize_t)b[at] << 16) | ((Py_ssize_t)b[at + 1] << 8) | b[at + 2];
            PyObject *msg = PyBytes_FromStringAndSize((const char *)b + at + 14, length - 5);
            if (msg == NULL) goto error;
            PyObject *r = PyObject_CallMethodOneArg(sink, s_append, msg);
            Py_DECREF(msg);
            if (r == NULL) goto error;
            Py_DECREF(r);
            at += 9 + length;
        }
        off = end;
        if (on_grpc_messages(s) < 0) goto error;
        end = next_run(b, n, off, max_frame, &sid, &frames, &total);
        if (frames == 0) goto done;
    }
done:
    result = PyLong_FromSsize_t(off);
    goto release;
error:
    result = NULL;
release:
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

/* direct_stream(cls): streams of exactly this class get ``on_grpc_messages`` done in C (see direct_type) */
static PyObject *direct_stream(PyObject *module, PyObject *cls) {
    (void)module;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "direct_stream takes a class");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(direct_type, cls);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"direct_stream", (PyCFunction)direct_stream, METH_O,
     "direct_stream(cls): grpc_data calls the listener of a stream of exactly this class itself when no "
     "waiter is set (what GrpcStream.on_grpc_messages does), without that method's Python frame"},
    {"grpc_data", (PyCFunction)(void (*)(void))grpc_data, METH_FASTCALL,
     "grpc_data(conn, data, off, max_frame) -> int: receive()'s frame loop over data[off:] for the runs of "
     "whole plain gRPC DATA frames there, in C; the offset of the first frame not taken"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_h2fast",
    "A paced engine's reads (runs of whole plain gRPC DATA frames) in C.", -1, methods, NULL, NULL, NULL,
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
                 {&s_on_grpc_messages, "on_grpc_messages"},
                 {&s_waiter, "_waiter"},
                 {&s_listener, "listener"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (*names[i].p == NULL && (*names[i].p = PyUnicode_InternFromString(names[i].s)) == NULL)
            return NULL;
    }
    return PyModule_Create(&module_def);
}
