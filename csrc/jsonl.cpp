// Fast path for tools/preprocess_data.py: the string values of a few keys of one JSONL line,
// as UTF-8 bytes, without building Python objects for the whole line.
//
//   extract_strings(line: bytes, keys: list[str]) -> list[bytes | None] | None
//   extract_strings_batch(lines: list[bytes], keys: list[str], span_min=0) -> list[that, per line]
//   extract_strings_lines(buffer, start, end, keys, span_min=0) -> per line of buffer[start:end)
//   count_newlines(buffer, start, end) -> int
//   unescape_span(line: bytes | buffer, start, end) -> bytes
//
// With span_min > 0, in a line of at least span_min bytes a value whose JSON string takes at least
// span_min bytes is returned as (start, end), the offsets of its contents (between the quotes) in
// the line, instead of bytes: the whole line is still checked as below, but that text is not
// copied; unescape_span decodes any part of it that begins and ends outside an escape sequence and
// a UTF-8 character (so a huge text can be decoded piece by piece while earlier pieces are
// tokenized).
//
// Contract (what makes it safe to use in front of Python's json module):
// - It returns a list only for a line that is one strict RFC 8259 JSON object in valid UTF-8
//   (optionally surrounded by JSON whitespace) whose strings contain no lone surrogate escape.
//   Every such line is accepted by json.loads, and for it the result equals
//   [obj[k].encode("utf-8") if isinstance(obj.get(k), str) else None for k in keys]
//   with obj = json.loads(line) (duplicate keys: the last one wins, as in json.loads).
// - For anything else it returns None and the caller parses the line with json.loads, which
//   then produces the value or the exact error message. Returning None is always safe; so
//   NaN/Infinity (accepted by json.loads, not by RFC 8259), lone surrogates, invalid UTF-8,
//   control characters in strings, trailing data and nesting deeper than kMaxDepth all go
//   back to Python.
// The GIL is released while parsing, so threads parse lines in parallel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace py = pybind11;

namespace {

// A large buffer written once from its start right after it was allocated (a huge line's text):
// asking for transparent huge pages before the first write makes the kernel fault it in 2 MB at
// a time instead of 4 KB (100 MB: ~85 ms of page faults -> ~20 ms on the benchmark VM, as numpy
// does for its large arrays). Only a hint; without THP ("never") nothing changes.
void advise_huge_pages(void* p, size_t n) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (n < 4 * kHuge) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)n;
#endif
}

// A bytes object of `size` bytes filled by `fill(char*)` (called with the GIL released when the
// object is large), its pages advised as above.
template <typename Fill>
py::bytes new_bytes(size_t size, Fill fill) {
  PyObject* obj = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(size));
  if (obj == nullptr) throw py::error_already_set();
  py::bytes out = py::reinterpret_steal<py::bytes>(obj);
  char* data = PyBytes_AS_STRING(obj);
  advise_huge_pages(data, size);
  if (size >= (size_t{1} << 20)) {
    py::gil_scoped_release release;
    fill(data);
  } else {
    fill(data);
  }
  return out;
}

// Eight bytes at a time (SWAR): a run of plain ASCII, or of four 2-byte UTF-8 characters
// (Cyrillic, Greek, ...), is checked with a few integer operations instead of a branch per byte.
constexpr uint64_t kOnes = 0x0101010101010101ULL;
constexpr uint64_t kHigh = 0x8080808080808080ULL;

inline uint64_t load8(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}
inline uint64_t has_zero_byte(uint64_t w) { return (w - kOnes) & ~w & kHigh; }
inline uint64_t has_byte_below(uint64_t w, unsigned n) { return (w - kOnes * n) & ~w & kHigh; }

// Eight bytes of a JSON string that are plain ASCII (0x20-0x7F except '"' and '\\') and complete
// 2-byte UTF-8 characters (lead C2-DF, continuation 80-BF), in any mix, checked without a branch
// per byte (words of two scripts mixed defeat branch prediction). `carry` is 1 when the byte
// before the eight was a lead byte (the first must then be its continuation), and is updated.
// False for anything else: those bytes are then taken one by one.
inline bool ascii_or_pairs8(uint64_t w, uint64_t* carry) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  const uint64_t hi = w & kHigh;                 // per byte, the flag in its top bit:
  const uint64_t b6 = (w << 1) & kHigh;          //   bit 6 of the byte
  const uint64_t b5 = (w << 2) & kHigh;          //   bit 5
  const uint64_t lead = hi & b6 & ~b5;           //   110xxxxx
  const uint64_t cont = hi & ~b6;                //   10xxxxxx
  const uint64_t t = w & (kOnes * 0x1E);         //   zero for the overlong leads C0, C1
  const uint64_t t_zero = ~(((t & (kOnes * 0x7F)) + kOnes * 0x7F) | t) & kHigh;
  const uint64_t bad = (hi & b6 & b5) | (lead & t_zero) | has_byte_below(w, 0x20) |
                       has_zero_byte(w ^ (kOnes * '"')) | has_zero_byte(w ^ (kOnes * '\\'));
  if (bad != 0 || cont != ((lead << 8) | (*carry << 7))) return false;
  *carry = lead >> 63;
  return true;
#else
  (void)w;
  (void)carry;
  return false;
#endif
}

#if defined(__SSE2__)
// The same check for 32 bytes with SSE2 (every x86-64 processor has it): per byte a bit in a
// mask, the pairing of leads and continuations checked on the masks. It roughly doubled the
// speed of checking a 100 MB string of mixed Russian and English (0.05-0.09 s before).
inline bool ascii_or_pairs32(const unsigned char* p, uint64_t* carry) {
  auto masks = [](const unsigned char* q, uint32_t* ok, uint32_t* lead, uint32_t* cont) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    // as signed bytes: ASCII 0..127, continuations 80-BF -128..-65, 2-byte leads C2-DF -62..-33
    const __m128i ascii = _mm_cmpgt_epi8(v, _mm_set1_epi8(-1));
    const __m128i special = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                                                      _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                                         _mm_and_si128(ascii, _mm_cmplt_epi8(v, _mm_set1_epi8(0x20))));
    const __m128i c = _mm_cmplt_epi8(v, _mm_set1_epi8(static_cast<char>(0xC0)));
    const __m128i l = _mm_and_si128(_mm_cmpgt_epi8(v, _mm_set1_epi8(static_cast<char>(0xC1))),
                                    _mm_cmplt_epi8(v, _mm_set1_epi8(static_cast<char>(0xE0))));
    *ok = static_cast<uint32_t>(_mm_movemask_epi8(_mm_andnot_si128(special, _mm_or_si128(ascii, _mm_or_si128(c, l)))));
    *lead = static_cast<uint32_t>(_mm_movemask_epi8(l));
    *cont = static_cast<uint32_t>(_mm_movemask_epi8(c));
  };
  uint32_t ok0, lead0, cont0, ok1, lead1, cont1;
  masks(p, &ok0, &lead0, &cont0);
  masks(p + 16, &ok1, &lead1, &cont1);
  const uint64_t ok = ok0 | (uint64_t{ok1} << 16);
  const uint64_t lead = lead0 | (uint64_t{lead1} << 16);
  const uint64_t cont = cont0 | (uint64_t{cont1} << 16);
  if (ok != 0xFFFFFFFFULL || cont != (((lead << 1) | *carry) & 0xFFFFFFFFULL)) return false;
  *carry = lead >> 31;
  return true;
}
#endif

constexpr int kMaxDepth = 256;

inline int hex_digit(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The four hex digits at p (before end) of a \u escape.
inline bool hex4(const unsigned char* p, const unsigned char* end, uint32_t* out) {
  if (end - p < 4) return false;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    const int h = hex_digit(p[i]);
    if (h < 0) return false;
    v = (v << 4) | static_cast<uint32_t>(h);
  }
  *out = v;
  return true;
}

// Code point cp as UTF-8 at o; returns the end of what was written (1-4 bytes).
inline char* write_utf8(uint32_t cp, char* o) {
  if (cp < 0x80) {
    *o++ = static_cast<char>(cp);
  } else if (cp < 0x800) {
    *o++ = static_cast<char>(0xC0 | (cp >> 6));
    *o++ = static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *o++ = static_cast<char>(0xE0 | (cp >> 12));
    *o++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *o++ = static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *o++ = static_cast<char>(0xF0 | (cp >> 18));
    *o++ = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *o++ = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *o++ = static_cast<char>(0x80 | (cp & 0x3F));
  }
  return o;
}

// Bytes that stand for themselves inside a JSON string: 0x20-0x7F except '"' and '\\'.
struct PlainAsciiTable {
  bool v[256] = {};
  PlainAsciiTable() {
    for (int c = 0x20; c < 0x80; ++c) v[c] = c != '"' && c != '\\';
  }
  bool operator[](unsigned char c) const { return v[c]; }
};
const PlainAsciiTable kPlainAscii;

// Parses [begin, end); requires *end == 0 (true of every CPython bytes object), which ends the
// scanning loops of parse_string without a bounds check per byte.
class Parser {
 public:
  // spans: the keys' string values are checked but not copied; spans() gives where they are.
  Parser(const unsigned char* begin, const unsigned char* end, const std::vector<std::string>& keys,
         bool spans = false)
      : p_(begin), end_(end), keys_(keys), found_(keys.size(), false), values_(keys.size()),
        spans_(spans ? keys.size() : 0), span_mode_(spans) {}

  // True when the whole input is one object (with optional surrounding whitespace).
  bool parse_line() {
    skip_ws();
    if (p_ == end_ || *p_ != '{') return false;
    if (!parse_object(/*top=*/true)) return false;
    skip_ws();
    return p_ == end_;
  }

  const std::vector<bool>& found() const { return found_; }
  std::vector<std::string>& values() { return values_; }
  // span mode: per key, [first byte of the string's contents, its closing quote)
  const std::vector<std::pair<const unsigned char*, const unsigned char*>>& spans() const { return spans_; }

 private:
  const unsigned char* p_;
  const unsigned char* end_;
  const std::vector<std::string>& keys_;
  std::vector<bool> found_;          // the key's last occurrence has a string value
  std::vector<std::string> values_;  // that value, UTF-8
  std::vector<std::pair<const unsigned char*, const unsigned char*>> spans_;
  bool span_mode_;
  int depth_ = 0;
  std::string scratch_;

  void skip_ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }

  bool read_u16(uint32_t* out) {  // p_ just after "\u"
    if (!hex4(p_, end_, out)) return false;
    p_ += 4;
    return true;
  }

  static void put_utf8(uint32_t cp, std::string* out) {
    char buf[4];
    out->append(buf, static_cast<size_t>(write_utf8(cp, buf) - buf));
  }

  // Length of the valid UTF-8 sequence at p_ (lead byte >= 0x80), or 0 when invalid
  // (overlong forms, surrogates and code points above U+10FFFF are invalid, as in Python).
  size_t utf8_len() const {
    const unsigned char* s = p_;
    const ptrdiff_t left = end_ - s;
    auto cont = [&](ptrdiff_t i, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
      return i < left && s[i] >= lo && s[i] <= hi;
    };
    unsigned char c = s[0];
    if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
    if (c == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
    if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) return cont(1) && cont(2) ? 3 : 0;
    if (c == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
    if (c == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
    if (c >= 0xF1 && c <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
    if (c == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
    return 0;
  }

  // p_ at the opening quote; appends the decoded string to out (when not null). Runs of
  // characters without escapes are validated first and copied with one append.
  bool parse_string(std::string* out) {
    ++p_;
    if (out) {
      const size_t had = out->capacity();
      out->reserve(out->size() + static_cast<size_t>(end_ - p_));
      if (out->capacity() != had) advise_huge_pages(&(*out)[0] + out->size(), out->capacity() - out->size());
    }
    const unsigned char* run = p_;
    auto flush = [&]() {
      if (out && p_ > run) out->append(reinterpret_cast<const char*>(run), p_ - run);
    };
    for (;;) {
      // Runs of plain ASCII mixed with 2-byte characters (Cyrillic, Greek, ...), eight bytes at
      // a time, then byte by byte up to what stops them (a quote, an escape, a control character,
      // a longer or invalid character, the end: handled below). The byte loops stop at the NUL
      // that CPython keeps after the end of every bytes object.
      for (;;) {
        const unsigned char* from = p_;
        uint64_t carry = 0;
#if defined(__SSE2__)
        while (end_ - p_ >= 32 && ascii_or_pairs32(p_, &carry)) p_ += 32;
#endif
        while (end_ - p_ >= 8 && ascii_or_pairs8(load8(p_), &carry)) p_ += 8;
        p_ -= carry;  // back to a lead byte whose continuation starts the word that stopped
        while (kPlainAscii[*p_]) ++p_;
        while (*p_ >= 0xC2 && *p_ <= 0xDF && (p_[1] & 0xC0) == 0x80) p_ += 2;
        if (p_ == from) break;
      }
      if (p_ >= end_) return false;
      unsigned char c = *p_;
      if (kPlainAscii[c]) continue;
      if (c >= 0x80) {
        size_t n = utf8_len();
        if (n == 0) return false;
        p_ += n;
        continue;
      }
      if (c == '"') {
        flush();
        ++p_;
        return true;
      }
      if (c < 0x20) return false;  // control characters must be escaped (json.loads, strict)
      flush();  // backslash escape
      ++p_;
      if (p_ == end_) return false;
      c = *p_++;
      char simple = 0;
      switch (c) {
        case '"': simple = '"'; break;
        case '\\': simple = '\\'; break;
        case '/': simple = '/'; break;
        case 'b': simple = '\b'; break;
        case 'f': simple = '\f'; break;
        case 'n': simple = '\n'; break;
        case 'r': simple = '\r'; break;
        case 't': simple = '\t'; break;
        case 'u': {
          uint32_t cp;
          if (!read_u16(&cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t lo;
            if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') return false;  // lone high surrogate
            p_ += 2;
            if (!read_u16(&lo) || lo < 0xDC00 || lo > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;  // lone low surrogate
          }
          if (out) put_utf8(cp, out);
          run = p_;
          continue;
        }
        default:
          return false;
      }
      if (out) out->push_back(simple);
      run = p_;
    }
  }

  bool parse_number() {
    if (p_ < end_ && *p_ == '-') ++p_;
    if (p_ == end_) return false;
    if (*p_ == '0') {
      ++p_;
    } else if (*p_ >= '1' && *p_ <= '9') {
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    } else {
      return false;
    }
    if (p_ < end_ && *p_ == '.') {
      ++p_;
      if (p_ == end_ || *p_ < '0' || *p_ > '9') return false;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      ++p_;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (p_ == end_ || *p_ < '0' || *p_ > '9') return false;
      while (p_ < end_ && *p_ >= '0' && *p_ <= '9') ++p_;
    }
    return true;
  }

  bool parse_literal(const char* word) {
    size_t n = std::strlen(word);
    if (static_cast<size_t>(end_ - p_) < n || std::memcmp(p_, word, n) != 0) return false;
    p_ += n;
    return true;
  }

  // Any value; when it is a string and out is not null, its text goes to out.
  bool parse_value(std::string* out, bool* is_string) {
    if (is_string) *is_string = false;
    if (p_ == end_) return false;
    switch (*p_) {
      case '"':
        if (is_string) *is_string = true;
        return parse_string(out);
      case '{':
        return parse_object(/*top=*/false);
      case '[':
        return parse_array();
      case 't':
        return parse_literal("true");
      case 'f':
        return parse_literal("false");
      case 'n':
        return parse_literal("null");
      default:
        return parse_number();
    }
  }

  bool parse_array() {
    if (++depth_ > kMaxDepth) return false;
    ++p_;
    skip_ws();
    if (p_ < end_ && *p_ == ']') {
      ++p_;
      --depth_;
      return true;
    }
    for (;;) {
      skip_ws();
      if (!parse_value(nullptr, nullptr)) return false;
      skip_ws();
      if (p_ == end_) return false;
      if (*p_ == ',') {
        ++p_;
        continue;
      }
      if (*p_ != ']') return false;
      ++p_;
      --depth_;
      return true;
    }
  }

  bool parse_object(bool top) {
    if (++depth_ > kMaxDepth) return false;
    ++p_;
    skip_ws();
    if (p_ < end_ && *p_ == '}') {
      ++p_;
      --depth_;
      return true;
    }
    for (;;) {
      skip_ws();
      if (p_ == end_ || *p_ != '"') return false;
      scratch_.clear();
      if (!parse_string(top ? &scratch_ : nullptr)) return false;
      int slot = -1;
      if (top) {
        for (size_t i = 0; i < keys_.size(); ++i) {
          if (keys_[i] == scratch_) {
            slot = static_cast<int>(i);
            break;
          }
        }
      }
      skip_ws();
      if (p_ == end_ || *p_ != ':') return false;
      ++p_;
      skip_ws();
      if (slot >= 0 && span_mode_) {
        const unsigned char* from = p_ + 1;
        bool is_string = false;
        if (!parse_value(nullptr, &is_string)) return false;
        found_[slot] = is_string;
        if (is_string) spans_[slot] = {from, p_ - 1};
      } else if (slot >= 0) {
        std::string& v = values_[slot];
        v.clear();
        bool is_string = false;
        if (!parse_value(&v, &is_string)) return false;
        found_[slot] = is_string;  // a later duplicate replaces an earlier value, as in json.loads
        if (!is_string) v.clear();
      } else if (!parse_value(nullptr, nullptr)) {
        return false;
      }
      skip_ws();
      if (p_ == end_) return false;
      if (*p_ == ',') {
        ++p_;
        continue;
      }
      if (*p_ != '}') return false;
      ++p_;
      --depth_;
      return true;
    }
  }
};

struct LineResult {
  bool ok = false;
  std::vector<bool> found;
  std::vector<std::string> values;
  std::vector<std::pair<size_t, size_t>> spans;  // (start, end) in the line; end == 0: decoded in values
};

// The contents of a checked JSON string, [p, end) with no quote in it, decoded into `out` (which
// the caller sizes to end - p: decoding never lengthens). Returns the bytes written, or
// std::string::npos for a malformed escape (never for a span the Parser accepted).
size_t unescape(const unsigned char* p, const unsigned char* end, char* out) {
  char* o = out;
  while (p < end) {
    const unsigned char* q = static_cast<const unsigned char*>(std::memchr(p, '\\', static_cast<size_t>(end - p)));
    const unsigned char* stop = q ? q : end;
    std::memcpy(o, p, static_cast<size_t>(stop - p));
    o += stop - p;
    if (!q) break;
    if (end - q < 2) return std::string::npos;
    p = q + 2;
    switch (q[1]) {
      case '"': *o++ = '"'; break;
      case '\\': *o++ = '\\'; break;
      case '/': *o++ = '/'; break;
      case 'b': *o++ = '\b'; break;
      case 'f': *o++ = '\f'; break;
      case 'n': *o++ = '\n'; break;
      case 'r': *o++ = '\r'; break;
      case 't': *o++ = '\t'; break;
      case 'u': {
        uint32_t cp = 0;
        if (!hex4(p, end, &cp)) return std::string::npos;
        p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t lo = 0;
          if (end - p < 6 || p[0] != '\\' || p[1] != 'u' || !hex4(p + 2, end, &lo) || lo < 0xDC00 || lo > 0xDFFF) {
            return std::string::npos;
          }
          p += 6;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          return std::string::npos;
        }
        o = write_utf8(cp, o);
        break;
      }
      default:
        return std::string::npos;
    }
  }
  return static_cast<size_t>(o - out);
}

const unsigned char* bytes_data(PyObject* obj, size_t* size) {
  char* data = nullptr;
  Py_ssize_t n = 0;
  if (!PyBytes_Check(obj)) throw py::type_error("extract_strings: lines must be bytes");
  if (PyBytes_AsStringAndSize(obj, &data, &n) != 0) throw py::error_already_set();
  if (data[n] != 0) throw std::logic_error("extract_strings: bytes object without its trailing NUL");
  *size = static_cast<size_t>(n);
  return reinterpret_cast<const unsigned char*>(data);
}

// span_min > 0: a line of at least span_min bytes is checked without copying its values; those of
// span_min bytes or more are left as spans, the others decoded from their checked contents.
// A read-only view of any object with the buffer protocol (bytes, mmap), released on destruction.
class View {
 public:
  explicit View(const py::handle& obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  }
  ~View() { PyBuffer_Release(&view_); }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  const unsigned char* data() const { return static_cast<const unsigned char*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_;
};

void parse_line(const unsigned char* data, size_t size, const std::vector<std::string>& keys, size_t span_min,
                LineResult* r) {
  const bool spans = span_min > 0 && size >= span_min;
  Parser parser(data, data + size, keys, spans);
  r->ok = parser.parse_line();
  if (!r->ok) return;
  r->found = parser.found();
  r->values = std::move(parser.values());
  r->spans.assign(keys.size(), {0, 0});
  if (!spans) return;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!r->found[i]) continue;
    const auto [from, to] = parser.spans()[i];
    if (static_cast<size_t>(to - from) >= span_min) {
      r->spans[i] = {static_cast<size_t>(from - data), static_cast<size_t>(to - data)};
      continue;
    }
    std::string& v = r->values[i];
    v.resize(static_cast<size_t>(to - from));
    const size_t n = unescape(from, to, &v[0]);
    if (n == std::string::npos) {  // the parser accepted it: cannot happen; let Python parse the line
      r->ok = false;
      return;
    }
    v.resize(n);
  }
}

py::object to_python(LineResult* r) {
  if (!r->ok) return py::none();
  py::list out(r->values.size());
  for (size_t i = 0; i < r->values.size(); ++i) {
    if (r->found[i] && r->spans[i].second != 0) {
      out[i] = py::make_tuple(r->spans[i].first, r->spans[i].second);
    } else if (r->found[i]) {
      const std::string& v = r->values[i];
      out[i] = new_bytes(v.size(), [&v](char* to) { std::memcpy(to, v.data(), v.size()); });
    } else {
      out[i] = py::none();
    }
    std::string().swap(r->values[i]);  // free a large text before building the next one
  }
  return std::move(out);
}

py::object extract_strings(const py::bytes& line, const std::vector<std::string>& keys) {
  size_t size = 0;
  const unsigned char* data = bytes_data(line.ptr(), &size);
  LineResult r;
  {
    py::gil_scoped_release release;  // `line` stays referenced by the caller
    parse_line(data, size, keys, 0, &r);
  }
  return to_python(&r);
}

// The same for every line of a batch, with one release of the GIL for the whole batch (one per
// line costs a hand-over between threads per line).
py::list extract_strings_batch(const py::list& lines, const std::vector<std::string>& keys, size_t span_min) {
  const size_t n = lines.size();
  std::vector<py::object> keep;  // the list could change once the GIL is released
  std::vector<std::pair<const unsigned char*, size_t>> spans(n);
  keep.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    keep.push_back(py::reinterpret_borrow<py::object>(lines[i]));
    spans[i].first = bytes_data(keep.back().ptr(), &spans[i].second);
  }
  std::vector<LineResult> results(n);
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < n; ++i) parse_line(spans[i].first, spans[i].second, keys, span_min, &results[i]);
  }
  py::list out(n);
  for (size_t i = 0; i < n; ++i) out[i] = to_python(&results[i]);
  return out;
}

// Every line of buffer[start:end) (a batch: a bytes object, or a range of a mapped file that
// starts at a line start), split at '\n' as bytes.split does, less the empty piece after a final
// newline: per line, extract_strings's list (spans as offsets in the buffer) when every key has a
// string value, or (line_start, line_end) for a line that Python must parse itself: one the fast
// path refuses or where a key is absent or not a string, and one not
// followed by a newline inside the buffer (nor by the NUL of a bytes object), which the scanning
// loops need as their sentinel. The lines are never copied into objects of their own.
py::list extract_strings_lines(const py::handle& buffer, size_t start, size_t end,
                               const std::vector<std::string>& keys, size_t span_min) {
  const View buf(buffer);
  if (start > end || end > buf.size()) throw py::value_error("extract_strings_lines: the range is outside the buffer");
  const unsigned char* data = buf.data();
  const bool nul_after = PyBytes_Check(buffer.ptr());
  std::vector<std::pair<size_t, size_t>> bounds;
  std::vector<LineResult> results;
  {
    py::gil_scoped_release release;  // `buffer` stays referenced by the caller
    size_t a = start;
    while (a < end) {
      const void* nl = std::memchr(data + a, '\n', end - a);
      const size_t b = nl == nullptr ? end : static_cast<size_t>(static_cast<const unsigned char*>(nl) - data);
      bounds.emplace_back(a, b);
      a = b + 1;
    }
    results.resize(bounds.size());
    for (size_t i = 0; i < bounds.size(); ++i) {
      const size_t a_i = bounds[i].first, b_i = bounds[i].second;
      const bool sentinel = b_i < buf.size() ? data[b_i] == '\n' : nul_after;
      if (sentinel) parse_line(data + a_i, b_i - a_i, keys, span_min, &results[i]);
    }
  }
  py::list out(bounds.size());
  for (size_t i = 0; i < bounds.size(); ++i) {
    LineResult& r = results[i];
    bool all_found = r.ok;
    for (size_t k = 0; all_found && k < r.found.size(); ++k) all_found = r.found[k];
    if (!all_found) {  // (a key absent or not a string: json.loads gives the message, or the skip)
      out[i] = py::make_tuple(bounds[i].first, bounds[i].second);
      continue;
    }
    for (auto& sp : r.spans) {
      if (sp.second != 0) sp = {sp.first + bounds[i].first, sp.second + bounds[i].first};
    }
    out[i] = to_python(&r);
  }
  return out;
}

// The number of newlines in buffer[start:end).
size_t count_newlines(const py::handle& buffer, size_t start, size_t end) {
  const View buf(buffer);
  if (start > end || end > buf.size()) throw py::value_error("count_newlines: the range is outside the buffer");
  const unsigned char* p = buf.data() + start;
  const unsigned char* const stop = buf.data() + end;
  size_t n = 0;
  py::gil_scoped_release release;
  while (p < stop) {
    const void* nl = std::memchr(p, '\n', static_cast<size_t>(stop - p));
    if (nl == nullptr) break;
    ++n;
    p = static_cast<const unsigned char*>(nl) + 1;
  }
  return n;
}

// The text of line[start:end) (line: bytes, or any buffer such as a mapped file), a part of a
// string's contents that extract_strings_batch or extract_strings_lines returned as a span, cut
// before and after a whole character outside any escape sequence.
py::bytes unescape_span(const py::handle& line, size_t start, size_t end) {
  const View buf(line);
  const unsigned char* data = buf.data();
  if (start > end || end > buf.size()) throw py::value_error("unescape_span: the span is outside the line");
  PyObject* obj = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(end - start));
  if (obj == nullptr) throw py::error_already_set();
  char* to = PyBytes_AS_STRING(obj);
  size_t n = 0;
  if (end - start >= (size_t{1} << 16)) {
    py::gil_scoped_release release;  // `line` stays referenced by the caller
    n = unescape(data + start, data + end, to);
  } else {
    n = unescape(data + start, data + end, to);
  }
  if (n == std::string::npos) {
    Py_DECREF(obj);
    throw py::value_error("unescape_span: a malformed or cut escape sequence in the span");
  }
  if (n != end - start && _PyBytes_Resize(&obj, static_cast<Py_ssize_t>(n)) != 0) throw py::error_already_set();
  return py::reinterpret_steal<py::bytes>(obj);
}

// `size` bytes of the open file `fd` from `offset` (a huge line, read whole by the reader), into
// a bytes object whose pages are advised as above; shorter only at the end of the file.
py::bytes read_range(int fd, int64_t offset, int64_t size) {
  if (size < 0 || offset < 0) throw py::value_error("read_range: negative offset or size");
  size_t got = 0;
  int err = 0;
  py::bytes out = new_bytes(static_cast<size_t>(size), [&](char* to) {
    while (got < static_cast<size_t>(size)) {
      const ssize_t n = pread(fd, to + got, static_cast<size_t>(size) - got, static_cast<off_t>(offset + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        err = errno;
        return;
      }
      if (n == 0) return;
      got += static_cast<size_t>(n);
    }
  });
  if (err != 0) {
    errno = err;
    PyErr_SetFromErrno(PyExc_OSError);
    throw py::error_already_set();
  }
  if (got < static_cast<size_t>(size)) return py::bytes(PyBytes_AS_STRING(out.ptr()), got);
  return out;
}

}  // namespace

PYBIND11_MODULE(_jsonl, m) {
  m.doc() = "Fast path for JSONL lines: string values of chosen keys as UTF-8 bytes (see csrc/jsonl.cpp).";
  m.def("extract_strings", &extract_strings, py::arg("line"), py::arg("keys"),
        "String values of `keys` in one JSONL line as UTF-8 bytes (None for a key that is absent or not a "
        "string), or None when the line is not a strict JSON object in valid UTF-8 without lone surrogate "
        "escapes (then parse it with json.loads).");
  m.def("extract_strings_batch", &extract_strings_batch, py::arg("lines"), py::arg("keys"), py::arg("span_min") = 0,
        "extract_strings for every line of a list (bytes), parsed with the GIL released once; with span_min, "
        "values of span_min bytes or more in lines of span_min bytes or more come back as (start, end) offsets of "
        "their contents in the line (checked, not copied: see unescape_span).");
  m.def("extract_strings_lines", &extract_strings_lines, py::arg("buffer"), py::arg("start"), py::arg("end"),
        py::arg("keys"), py::arg("span_min") = 0,
        "extract_strings for every line of buffer[start:end) (split at newlines as bytes.split, less the empty "
        "piece after a final newline), with the GIL released once; spans are offsets in the buffer, and a line "
        "left to Python (refused, or a key absent or not a string) comes back as its (start, end) in the buffer.");
  m.def("count_newlines", &count_newlines, py::arg("buffer"), py::arg("start"), py::arg("end"),
        "The number of newlines in buffer[start:end) (the GIL released).");
  m.def("unescape_span", &unescape_span, py::arg("line"), py::arg("start"), py::arg("end"),
        "The UTF-8 text of line[start:end), part of a string value that extract_strings_batch returned as a span, "
        "cut outside escape sequences and characters.");
  m.def("read_range", &read_range, py::arg("fd"), py::arg("offset"), py::arg("size"),
        "`size` bytes of the file descriptor `fd` from `offset` (fewer at the end of the file), read with "
        "the GIL released into a bytes object backed by huge pages where the system offers them.");
}
