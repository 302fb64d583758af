/* Word-by-word encoding of ASCII text for byte-level BPE tokenizers (router/word_encoder.py).
 *
 * scan(text, rule, at, words) cuts an ASCII ``text`` into the words one of three known word expressions cuts it
 * into (GPT-2's, Llama 3's, Qwen 2's; ``rule`` 0, 1, 2), looks each word's ids up in ``words`` (a mapping: a dict,
 * or a dict subclass whose __missing__ computes them), and returns (ids, starts): every id, and for each where its
 * word begins, counted from ``at``, each as the bytes of an array of uint32 (what array("I") holds where kvroute
 * runs; word_encoder.py checks that at import). It returns None for text that is not ASCII: the caller cuts that
 * with ``re``.
 *
 * On ASCII text the expressions' classes are plain: \p{L} is [A-Za-z], \p{N} is [0-9], \s is [\t\n\v\f\r ]; every
 * other character is "other". Each rule below is the expression's alternatives tried in order at the start of a
 * word, each greedy, with the backtracking of \s+(?!\S) and \s*[\r\n]+ worked out; the tests compare every rule
 * with Python's re on random text.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { RULE_GPT2 = 0, RULE_LLAMA3 = 1, RULE_QWEN2 = 2 };

#define IS_L(c) ((unsigned)(((c) | 0x20) - 'a') < 26u)
#define IS_N(c) ((unsigned)((c) - '0') < 10u)
#define IS_S(c) ((c) == ' ' || (unsigned)((c) - '\t') < 5u)
#define IS_CRLF(c) ((c) == '\r' || (c) == '\n')
#define IS_OTHER(c) (!IS_L(c) && !IS_N(c) && !IS_S(c))

static Py_ssize_t run_of_letters(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    while (i < n && IS_L(s[i])) i++;
    return i;
}

static Py_ssize_t run_of_others(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    while (i < n && IS_OTHER(s[i])) i++;
    return i;
}

/* 's 't 're 've 'm 'll 'd at i (s[i] == '\''): the end of the one found, or i */
static Py_ssize_t contraction(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, int fold) {
    if (i + 1 >= n) return i;
    unsigned char a = s[i + 1], b = i + 2 < n ? s[i + 2] : 0;
    if (fold) {
        a = (unsigned char)(IS_L(a) ? (a | 0x20) : a);
        b = (unsigned char)(IS_L(b) ? (b | 0x20) : b);
    }
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    return i;
}

/* \s+(?!\S)|\s+ at i (s[i] is white space): the run, less its last character where a non-space follows it */
static Py_ssize_t spaces(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    Py_ssize_t j = i;
    while (j < n && IS_S(s[j])) j++;
    return (j < n && j - i >= 2) ? j - 1 : j;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static Py_ssize_t next_gpt2(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) {
    unsigned char c = s[i];
    if (c == '\'') {
        Py_ssize_t j = contraction(s, i, n, 0);
        if (j > i) return j;
    }
    Py_ssize_t k = (c == ' ' && i + 1 < n) ? i + 1 : i;  /* the optional leading space */
    unsigned char d = s[k];
    if (IS_L(d)) return run_of_letters(s, k, n);
    if (IS_N(d)) {
        while (k < n && IS_N(s[k])) k++;
        return k;
    }
    if (IS_OTHER(d)) return run_of_others(s, k, n);
    return spaces(s, i, n);
}

/* Llama 3 (digits: 3 at most) and Qwen 2 (digits: 1):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static Py_ssize_t next_llama(const unsigned char *s, Py_ssize_t i, Py_ssize_t n, int digits) {
    unsigned char c = s[i];
    if (c == '\'') {
        Py_ssize_t j = contraction(s, i, n, 1);
        if (j > i) return j;
    }
    if (IS_L(c)) return run_of_letters(s, i, n);
    if (!IS_CRLF(c) && !IS_N(c) && i + 1 < n && IS_L(s[i + 1])) return run_of_letters(s, i + 1, n);
    if (IS_N(c)) {
        Py_ssize_t j = i;
        while (j < n && j - i < digits && IS_N(s[j])) j++;
        return j;
    }
    Py_ssize_t k = (c == ' ' && i + 1 < n) ? i + 1 : i;
    if (IS_OTHER(s[k])) {
        Py_ssize_t j = run_of_others(s, k, n);
        while (j < n && IS_CRLF(s[j])) j++;
        return j;
    }
    /* c is white space: \s*[\r\n]+ ends just past the run's last \r or \n, if it has one */
    Py_ssize_t j = i, last = -1;
    while (j < n && IS_S(s[j])) {
        if (IS_CRLF(s[j])) last = j;
        j++;
    }
    if (last >= 0) return last + 1;
    return spaces(s, i, n);
}

/* a growing array of uint32 */
typedef struct {
    uint32_t *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_push(Buf *b, uint32_t v) {
    if (b->len == b->cap) {
        Py_ssize_t cap = b->cap ? 2 * b->cap : 1024;
        uint32_t *data = PyMem_Realloc(b->data, (size_t)cap * sizeof(uint32_t));
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
        b->cap = cap;
    }
    b->data[b->len++] = v;
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *text, *words;
    int rule;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "UinO:scan", &text, &rule, &at, &words)) return NULL;
    if (rule < RULE_GPT2 || rule > RULE_QWEN2) {
        PyErr_SetString(PyExc_ValueError, "unknown word rule");
        return NULL;
    }
    if (at < 0 || at + PyUnicode_GET_LENGTH(text) > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "places past 2**32");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(text)) Py_RETURN_NONE;
    const unsigned char *s = (const unsigned char *)PyUnicode_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    Buf ids = {NULL, 0, 0}, starts = {NULL, 0, 0};
    PyObject *out = NULL;
    int is_dict = PyDict_Check(words);
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t j = rule == RULE_GPT2 ? next_gpt2(s, i, n) : next_llama(s, i, n, rule == RULE_LLAMA3 ? 3 : 1);
        PyObject *word = PyUnicode_New(j - i, 127);
        if (word == NULL) goto done;
        memcpy(PyUnicode_DATA(word), s + i, (size_t)(j - i));
        PyObject *got = is_dict ? PyDict_GetItemWithError(words, word) : NULL;  /* borrowed */
        if (got != NULL) {
            Py_INCREF(got);
        } else if (PyErr_Occurred()) {
            Py_DECREF(word);
            goto done;
        } else {
            got = PyObject_GetItem(words, word);  /* a miss: __missing__ computes and keeps it */
        }
        Py_DECREF(word);
        if (got == NULL) goto done;
        PyObject *seq = PySequence_Fast(got, "a word's ids must be a sequence");
        Py_DECREF(got);
        if (seq == NULL) goto done;
        Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t t = 0; t < m; t++) {
            unsigned long id = PyLong_AsUnsignedLong(items[t]);
            if ((id == (unsigned long)-1 && PyErr_Occurred()) || id > UINT32_MAX) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_OverflowError, "a token id past 2**32");
                Py_DECREF(seq);
                goto done;
            }
            if (buf_push(&ids, (uint32_t)id) < 0 || buf_push(&starts, (uint32_t)(at + i)) < 0) {
                Py_DECREF(seq);
                goto done;
            }
        }
        Py_DECREF(seq);
        i = j;
    }
    {
        PyObject *a = PyBytes_FromStringAndSize((const char *)ids.data, ids.len * (Py_ssize_t)sizeof(uint32_t));
        PyObject *b = a ? PyBytes_FromStringAndSize((const char *)starts.data,
                                                    starts.len * (Py_ssize_t)sizeof(uint32_t)) : NULL;
        if (a != NULL && b != NULL) out = PyTuple_Pack(2, a, b);
        Py_XDECREF(a);
        Py_XDECREF(b);
    }
done:
    PyMem_Free(ids.data);
    PyMem_Free(starts.data);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(text, rule, at, words) -> (ids, starts) | None: ASCII text cut into words by a known word rule "
     "(0 GPT-2, 1 Llama 3, 2 Qwen 2), each word's ids looked up in words, as the bytes of arrays of uint32 in "
     "native order (array('I')); None for text that is not ASCII."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wordscan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wordscan(void) { return PyModule_Create(&module); }
