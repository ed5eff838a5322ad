#!/usr/bin/env python3
"""Text to a Strata token file, with a Hugging Face tokenizer.

Reads text files (one document each), JSON lines (one document per line, the
text in a named field), Parquet files (one document per row, the text in a
named string column, read row group by row group with pyarrow) or
directories of them (recursively, in sorted order; *.jsonl and *.json are JSON
lines, *.parquet Parquet, anything else text; hidden and "_"-prefixed files
skipped),
and writes
  OUT        the token ids, little-endian uint16 or uint32, an EOS id after
             every document (so between any two), nothing else;
  OUT.json   its sidecar: {"format": "strata-tokens", "tokenizer": ...,
             "vocab_size": ..., "tokens": ..., "dtype": ..., "eos_id": ...,
             "documents": ...}. `strata train` reads it: data.format comes
             from "dtype" when the config does not set it, and a tokenizer
             vocabulary larger than model.vocab_size, or a file whose size is
             not tokens x width, is refused (docs/config.md, data.path).
Memory is bounded: documents are encoded in batches (the `tokenizers`
package's encode_batch_fast, on every core, while a reader thread parses the
next batch) and written as they are encoded; a
text file larger than --piece-mb is encoded in pieces cut at line ends. Both
files are written under temporary names and renamed at the end: an error or
an interrupt leaves neither behind.

Fine-tuning examples (docs/token-format.md, "Examples and loss masks"): JSON
lines or Parquet rows with `messages` (a list of {role, content}, rendered by
the chat template of the tokenizer's tokenizer_config.json through
transformers' apply_chat_template) or `prompt` + `completion` are examples,
detected from the first row. Then it also writes
  OUT.mask   one byte per token: 1 where the token counts toward the loss
             (each assistant turn after the template's generation prompt
             through its first eos; a completion and the eos appended);
  OUT.idx    little-endian uint64 offsets, examples + 1 of them: example i
             is tokens [idx[i], idx[i + 1]);
and the sidecar says so ("version": 2, "examples", "mask", "index",
"counted").

usage: tokenize.py --tokenizer DIR --out FILE [--field text] [--dtype auto|uint16|uint32]
                   [--eos-token TOKEN] [--batch-docs 512] INPUT...
DIR: a directory holding tokenizer.json (a Hugging Face model directory), or the file itself.
"""
# This file shares its name with the standard library's `tokenize` module.
# Run as a script, it keeps this directory off the import path so that the
# modules it imports get the real one; imported as `tokenize` by another
# script in tools/ (linecache does, for tracebacks and matplotlib), it hands
# the importer the standard library's module instead of itself.
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
if __name__ != "__main__":
    import importlib

    del sys.modules[__name__]
    _real = importlib.import_module("tokenize")
    sys.modules[__name__] = _real
    globals().update(_real.__dict__)

import argparse  # noqa: E402
import json  # noqa: E402
import queue  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class InputProblem(Exception):
    """Bad input: reported as one line naming the file (and line), exit 2."""


def find_tokenizer(path):
    """The tokenizer.json file for --tokenizer PATH (a directory or the file)."""
    if os.path.isdir(path):
        f = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(f):
            raise InputProblem(f"{path}: no tokenizer.json in this directory (--tokenizer needs a Hugging Face "
                               "tokenizer.json or the directory that holds one)")
        return f
    if not os.path.isfile(path):
        raise InputProblem(f"{path}: does not exist (--tokenizer)")
    return path


def eos_id(tok, tokenizer_file, name):
    """The id appended after every document: --eos-token, else the eos_token
    of tokenizer_config.json beside the tokenizer, else a usual name."""
    if name is None:
        cfg = os.path.join(os.path.dirname(tokenizer_file), "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg) as f:
                e = json.load(f).get("eos_token")
            if isinstance(e, dict):
                e = e.get("content")
            if isinstance(e, str):
                name = e
    candidates = [name] if name is not None else list(EOS_NAMES)
    for c in candidates:
        i = tok.token_to_id(c)
        if i is not None:
            return c, i
    if name is not None:
        raise InputProblem(f"{tokenizer_file}: the tokenizer has no token {name!r} (--eos-token)")
    raise InputProblem(f"{tokenizer_file}: no end-of-document token found (tried {', '.join(EOS_NAMES)}); "
                       "name one with --eos-token")


def input_files(inputs):
    """Every input file, directories walked in sorted order."""
    out = []
    for p in inputs:
        if os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                # Hidden files, and "_"-prefixed ones (Spark's and Hugging Face's _SUCCESS markers,
                # _metadata): not documents.
                out.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith((".", "_")))
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise InputProblem(f"{p}: does not exist (input)")
    if not out:
        raise InputProblem(f"{' '.join(inputs)}: no input files")
    return out


def parquet_documents(path, field):
    """(text, True, bytes) per row of column `field` of a Parquet file, read a
    batch of rows at a time (row group by row group): memory stays flat in the
    file's size."""
    try:
        import pyarrow.parquet as pq
        import pyarrow.types as pat
    except ImportError:
        raise InputProblem(f"{path}: reading Parquet needs pyarrow (tools/setup.sh installs it into .venv)")
    try:
        # pre_buffer off: pyarrow would otherwise keep every row group it
        # has read (the whole file by the end; BENCHMARKS.md, "tokenize.py").
        pf = pq.ParquetFile(path, pre_buffer=False)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise InputProblem(f"{path}: not a Parquet file ({e})")
    schema = pf.schema_arrow
    if field not in schema.names:
        raise InputProblem(f"{path}: no column {field!r} (--field); columns: {', '.join(schema.names)}")
    kind = schema.field(field).type
    if not (pat.is_string(kind) or pat.is_large_string(kind)):
        raise InputProblem(f"{path}: column {field!r} is {kind}, not a string column (--field)")
    row = 0
    batches = pf.iter_batches(batch_size=1024, columns=[field])
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # a corrupt page or row group: pyarrow's ArrowInvalid, OSError
            raise InputProblem(f"{path}: cannot read the rows after row {row} ({e})")
        if batch is None:
            break
        for text in batch.column(0).to_pylist():
            row += 1
            if text is None:
                raise InputProblem(f"{path}: row {row}: {field!r} is null")
            yield text, True, len(text.encode("utf-8"))


def json_lines(path):
    """(line number, bytes, parsed value) per non-blank line of a JSON lines file."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputProblem(f"{path}:{n}: not a JSON object ({e})")
            yield n, len(line), obj


def documents(files, field, piece_bytes):
    """(text, ends_document, bytes read) pieces, in order, from every file."""
    for path in files:
        if path.endswith(".parquet"):
            yield from parquet_documents(path, field)
        elif path.endswith(".jsonl") or path.endswith(".json"):
            for n, size, obj in json_lines(path):
                text = obj.get(field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise InputProblem(f"{path}:{n}: no string field {field!r} (--field)")
                yield text, True, size
        else:
            with open(path, "rb") as f:
                pending = b""
                while True:
                    chunk = f.read(piece_bytes)
                    if not chunk:
                        break
                    data = pending + chunk
                    cut = data.rfind(b"\n") + 1
                    if cut == 0:  # no line end yet: a piece must end at one
                        pending = data
                        continue
                    pending = data[cut:]
                    yield decode(path, data[:cut]), False, cut
                yield decode(path, pending), True, len(pending)


def decode(path, data):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputProblem(f"{path}: not UTF-8 text near byte {e.start} of a piece ({e.reason})")


class Progress:
    """One line on stderr, redrawn at most twice a second."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.start = time.monotonic()
        self.last = 0.0

    def update(self, docs, tokens, nbytes, final=False):
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 0.5):
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        sys.stderr.write(f"\rtokenize: {docs:,} documents, {tokens:,} tokens, {nbytes / 1e6:,.1f} MB | "
                         f"{docs / dt:,.0f} docs/s, {tokens / dt:,.0f} tokens/s, {nbytes / 1e6 / dt:,.1f} MB/s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()


ROLES = ("system", "user", "assistant", "tool")


def first_row(files):
    """The first row of the first JSON lines or Parquet input (None for text)."""
    path = files[0]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
            batch = next(pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=1), None)
        except Exception:
            return None  # reported by the reader
        return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
    if path.endswith(".jsonl") or path.endswith(".json"):
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        return None
                    return obj if isinstance(obj, dict) else None
    return None


def example_kind(files):
    """"messages" or "prompt_completion" when the first row is an example, else None."""
    row = first_row(files)
    if not isinstance(row, dict):
        return None
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    return None


def example_rows(files, kind):
    """(where, row) per example, in order: where is "FILE:LINE" or "FILE: row N"."""
    for path in files:
        if path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
                pf = pq.ParquetFile(path, pre_buffer=False)
            except ImportError:
                raise InputProblem(f"{path}: reading Parquet needs pyarrow (tools/setup.sh installs it into .venv)")
            except Exception as e:
                raise InputProblem(f"{path}: not a Parquet file ({e})")
            row = 0
            for batch in pf.iter_batches(batch_size=1024):
                for obj in batch.to_pylist():
                    row += 1
                    yield f"{path}: row {row}", obj
        elif path.endswith(".jsonl") or path.endswith(".json"):
            for n, _, obj in json_lines(path):
                if not isinstance(obj, dict):
                    raise InputProblem(f"{path}:{n}: not a JSON object")
                yield f"{path}:{n}", obj
        else:
            raise InputProblem(f"{path}: a text file among examples ({kind}: JSON lines or Parquet only)")


def check_messages(where, obj):
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InputProblem(f"{where}: no 'messages' list (the first row's rows are conversations)")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise InputProblem(f"{where}: messages[{i}] is not {{role, content}} with string content")
        if m.get("role") not in ROLES:
            raise InputProblem(f"{where}: messages[{i}] has role {m.get('role')!r}, not one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise InputProblem(f"{where}: no assistant turn (nothing would count toward the loss)")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


class ExampleRenderer:
    """Examples to (text, [(first char, counted up to the first eos)]) and
    then to ids and a mask. Chat: the tokenizer's own chat template through
    transformers' apply_chat_template (tokenize=False; the ids are its
    tokenize=True ids: the rendered text encoded without special tokens);
    each assistant turn counts from the end of what the template renders for
    the messages before it with add_generation_prompt=True, through the first
    eos after that. Prompt + completion: TRL's rule, the concatenation
    encoded with the tokenizer's special tokens, counted from the length of
    the prompt's own encoding, and eos appended unless already last."""

    def __init__(self, kind, tokenizer_file, tok, eos):
        self.kind, self.tok, self.eos = kind, tok, eos
        self.hf = None
        if kind == "messages":
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise InputProblem("rendering chat templates needs transformers (tools/setup.sh installs it into .venv)")
            d = os.path.dirname(tokenizer_file)
            try:
                self.hf = AutoTokenizer.from_pretrained(d)
            except Exception as e:
                raise InputProblem(f"{d}: transformers cannot load this tokenizer ({e})")
            if not getattr(self.hf, "chat_template", None):
                raise InputProblem(f"{d}: tokenizer_config.json has no chat_template (messages need one)")

    def render(self, where, obj):
        """(text, starts, prompt_text): starts are the char offsets where counting begins."""
        if self.kind == "prompt_completion":
            p, c = obj.get("prompt"), obj.get("completion")
            if not isinstance(p, str) or not isinstance(c, str):
                raise InputProblem(f"{where}: 'prompt' and 'completion' must both be strings")
            return p + c, None, p
        msgs = check_messages(where, obj)
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False)
            starts = []
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                prefix = self.hf.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True)
                if not text.startswith(prefix):
                    raise InputProblem(f"{where}: the chat template does not render messages[:{i}] with its "
                                       "generation prompt as the start of the conversation")
                starts.append(len(prefix))
        except InputProblem:
            raise
        except Exception as e:  # jinja2's errors, the template's raise_exception
            raise InputProblem(f"{where}: the chat template fails on this row ({e})")
        return text, starts, None

    def encode(self, where, rendered, enc, prompt_enc):
        """ids and mask (lists) of one rendered example."""
        text, starts, prompt = rendered
        ids = list(enc.ids)
        if self.kind == "prompt_completion":
            n = min(len(prompt_enc.ids), len(ids))  # (a merge across the boundary cannot make it longer)
            if not ids or ids[-1] != self.eos:
                ids.append(self.eos)
            return ids, [0] * n + [1] * (len(ids) - n)
        mask = [0] * len(ids)
        offsets = enc.offsets
        j = 0
        for start in starts:
            # The turn's first counted token: the first that reaches past the
            # generation prompt (one the encoder merged across the boundary
            # holds the reply's first characters: it counts).
            while j < len(ids) and offsets[j][1] <= start:
                j += 1
            k = j
            while k < len(ids) and ids[k] != self.eos:
                k += 1
            if k == len(ids):
                raise InputProblem(f"{where}: an assistant turn without the eos token after it (id {self.eos}; "
                                   "--eos-token names the template's end of turn)")
            for t in range(j, k + 1):
                mask[t] = 1
            j = k + 1
        return ids, mask


def tokenize_examples(args, kind, files, tokenizer_file, tok, vocab, dtype, eos_name, eos, code):
    """Examples: OUT, OUT.mask, OUT.idx and the sidecar, each under a temporary name until all are done."""
    from array import array
    renderer = ExampleRenderer(kind, tokenizer_file, tok, eos)
    names = [args.out, args.out + ".mask", args.out + ".idx", args.out + ".json"]
    tmps = [f"{n}.tmp{os.getpid()}" for n in names]
    examples = tokens = counted = 0
    progress = Progress(args.progress)
    encode = tok.encode_batch  # with character offsets: the mask needs them
    try:
        with open(tmps[0], "wb") as out, open(tmps[1], "wb") as mask_out, open(tmps[2], "wb") as idx_out:
            array("Q", [0]).tofile(idx_out)
            rows = example_rows(files, kind)
            while True:
                batch = []
                for item in rows:
                    batch.append(item)
                    if len(batch) >= args.batch_docs:
                        break
                if not batch:
                    break
                rendered = [renderer.render(w, o) for w, o in batch]
                specials = kind == "prompt_completion"
                encs = encode([r[0] for r in rendered], add_special_tokens=specials)
                prompts = encode([r[2] for r in rendered], add_special_tokens=True) if specials else [None] * len(batch)
                ids_out, mask_bytes, ends = array(code), bytearray(), array("Q")
                for (w, _), r, e, pe in zip(batch, rendered, encs, prompts):
                    ids, mask = renderer.encode(w, r, e, pe)
                    ids_out.extend(ids)
                    mask_bytes.extend(mask)
                    tokens += len(ids)
                    counted += sum(mask)
                    ends.append(tokens)
                    examples += 1
                ids_out.tofile(out)
                mask_out.write(mask_bytes)
                ends.tofile(idx_out)
                progress.update(examples, tokens, 0)
            if examples == 0:
                raise InputProblem(f"{' '.join(args.inputs)}: no examples")
            for f in (out, mask_out, idx_out):
                f.flush()
                os.fsync(f.fileno())
        base = os.path.basename(args.out)
        side = {"format": "strata-tokens", "version": 2, "tokenizer": os.path.abspath(tokenizer_file),
                "vocab_size": vocab, "tokens": tokens, "dtype": dtype, "eos_id": eos, "eos_token": eos_name,
                "documents": examples, "examples": examples, "kind": kind, "counted": counted,
                "mask": base + ".mask", "index": base + ".idx"}
        with open(tmps[3], "w") as f:
            json.dump(side, f, indent=2)
            f.write("\n")
        # An old sidecar goes first, the new one last (it names the others):
        # an interrupt between the renames leaves no sidecar that describes
        # other files than those beside it.
        if os.path.exists(names[3]):
            os.unlink(names[3])
        for t, n in zip(tmps, names):
            os.replace(t, n)
    except BaseException:
        for t in tmps:
            if os.path.exists(t):
                os.unlink(t)
        raise
    progress.update(examples, tokens, 0, final=True)
    print(f"tokenize: wrote {args.out} ({tokens:,} {dtype} tokens, {examples:,} examples ({kind}), "
          f"{counted:,} counted toward the loss, vocabulary {vocab}), {args.out}.mask, {args.out}.idx "
          f"and {args.out}.json")


def tokenize(args):
    from array import array

    from tokenizers import Tokenizer

    tokenizer_file = find_tokenizer(args.tokenizer)
    files = input_files(args.inputs)
    try:
        tok = Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # the package raises a bare Exception for a malformed file
        raise InputProblem(f"{tokenizer_file}: not a Hugging Face tokenizer.json ({e})")
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "uint16" if vocab <= 65536 else "uint32"
    if dtype == "uint16" and vocab > 65536:
        raise InputProblem(f"{tokenizer_file}: a vocabulary of {vocab} does not fit uint16 (--dtype uint32)")
    eos_name, eos = eos_id(tok, tokenizer_file, args.eos_token)
    code = "H" if dtype == "uint16" else "I"
    if array(code).itemsize != (2 if dtype == "uint16" else 4) or sys.byteorder != "little":
        raise SystemExit("tokenize: this machine's array widths or byte order are not what token files use")

    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise InputProblem(f"{args.out}: its directory does not exist (--out)")
    kind = example_kind(files)
    if kind is not None:
        return tokenize_examples(args, kind, files, tokenizer_file, tok, vocab, dtype, eos_name, eos, code)
    tmp, tmp_side = f"{args.out}.tmp{os.getpid()}", f"{args.out}.json.tmp{os.getpid()}"
    docs = tokens = nbytes = 0
    progress = Progress(args.progress)
    try:
        with open(tmp, "wb") as out:
            # A reader thread parses the inputs into batches while the main
            # thread encodes the previous one (encode_batch releases the GIL
            # and runs on every core): reading and JSON parsing are hidden
            # behind encoding. At most two batches wait (bounded memory).
            batches = queue.Queue(maxsize=2)
            stop = threading.Event()

            def read():
                batch, ends, size = [], [], 0
                try:
                    for text, end, n in documents(files, args.field, args.piece_mb << 20):
                        batch.append(text)
                        ends.append(end)
                        size += n
                        if len(batch) >= args.batch_docs:
                            batches.put((batch, ends, size))
                            batch, ends, size = [], [], 0
                            if stop.is_set():
                                return
                    batches.put((batch, ends, size))
                    batches.put(None)
                except BaseException as e:  # handed to the main thread, which reports it
                    batches.put(e)

            # The ids only: encode_batch_fast (tokenizers >= 0.21) skips the
            # character offsets encode_batch computes, the same ids ~1.5x faster.
            encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            try:
                while True:
                    item = batches.get()
                    if item is None:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    batch, ends, size = item
                    ids = array(code)
                    for enc, end in zip(encode(batch, add_special_tokens=False), ends):
                        ids.extend(enc.ids)
                        if end:
                            ids.append(eos)
                            docs += 1
                    ids.tofile(out)
                    tokens += len(ids)
                    nbytes += size
                    progress.update(docs, tokens, nbytes)
            finally:
                stop.set()
                while reader.is_alive():  # unblock a reader waiting on a full queue
                    try:
                        batches.get_nowait()
                    except queue.Empty:
                        pass
                    reader.join(0.05)
            out.flush()
            os.fsync(out.fileno())
        side = {"format": "strata-tokens", "tokenizer": os.path.abspath(tokenizer_file), "vocab_size": vocab,
                "tokens": tokens, "dtype": dtype, "eos_id": eos, "eos_token": eos_name, "documents": docs}
        with open(tmp_side, "w") as f:
            json.dump(side, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.out)
        os.replace(tmp_side, args.out + ".json")
    except BaseException:
        for p in (tmp, tmp_side):
            if os.path.exists(p):
                os.unlink(p)
        raise
    progress.update(docs, tokens, nbytes, final=True)
    print(f"tokenize: wrote {args.out} ({tokens:,} {dtype} tokens, {docs:,} documents, vocabulary {vocab}) "
          f"and {args.out}.json")


def main():
    ap = argparse.ArgumentParser(description="Text to a Strata token file with a Hugging Face tokenizer.")
    ap.add_argument("--tokenizer", required=True, help="directory holding tokenizer.json, or the file")
    ap.add_argument("--out", required=True, help="token file to write (its sidecar is OUT.json)")
    ap.add_argument("--field", default="text",
                    help="the text field of JSON lines, the text column of Parquet files (default: text)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"],
                    help="token width; auto = uint16 when the vocabulary fits, else uint32")
    ap.add_argument("--eos-token", default=None,
                    help="token appended after every document (default: tokenizer_config.json's eos_token, "
                         "else " + ", ".join(EOS_NAMES) + ")")
    ap.add_argument("--batch-docs", type=int, default=512, help="documents encoded per batch (default 512)")
    ap.add_argument("--piece-mb", type=int, default=4, help="text files are encoded in pieces of this size")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress line")
    ap.add_argument("inputs", nargs="+", help="text, JSON lines or Parquet files, or directories of them")
    args = ap.parse_args()
    if args.batch_docs < 1 or args.piece_mb < 1:
        ap.error("--batch-docs and --piece-mb must be positive")
    try:
        tokenize(args)
    except InputProblem as e:
        sys.stderr.write(f"tokenize: {e}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("\ntokenize: interrupted; nothing written\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
