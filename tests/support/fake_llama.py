"""Fake llama.cpp and whisper.cpp tools: real executables on a PATH the agent searches.

Each reads the flags the agent passes (an unknown flag is an error, as with the real tools),
checks the model file it is given, takes a little time, prints its answer where the real tool
does (text on stdout, logs and timings on stderr) and fails when the input tells it to: a
prompt or file containing FAIL, or FAKE_LLAMA_FAIL=1 in the environment.
"""

from __future__ import annotations

import hashlib
import io
import json
import wave
import zipfile
from pathlib import Path

from tests.support.agent import make_tool

GGUF_MODEL = b"GGUF fake model weights"

# Shared by every fake: parse `-x value` / `--flag value` / bare switches, refuse others.
_PRELUDE = r'''
def parse(valued, switches=()):
    args, rest, argv = {}, [], sys.argv[1:]
    i = 0
    while i < len(argv):
        word = argv[i]
        if word in valued:
            args[word] = argv[i + 1]
            i += 2
        elif word in switches:
            args[word] = True
            i += 1
        elif word.startswith("-"):
            print(f"error: unknown argument: {word}", file=sys.stderr)
            sys.exit(1)
        else:
            rest.append(word)
            i += 1
    return args, rest

def need_gguf(path):
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            print(f"gguf_init_from_file: invalid magic in {path}", file=sys.stderr)
            sys.exit(1)

def maybe_fail(text=""):
    if os.environ.get("FAKE_LLAMA_FAIL") or "FAIL" in text:
        print("error: the fake tool was told to fail", file=sys.stderr)
        sys.exit(1)

def perf(prompt_n, gen_n):
    print("llama_perf_sampler_print:    sampling time =       1.00 ms", file=sys.stderr)
    print("llama_perf_context_print:        load time =      12.50 ms", file=sys.stderr)
    print(f"llama_perf_context_print: prompt eval time =      {prompt_n * 2.0:.2f} ms / "
          f"{prompt_n:5d} tokens (    2.00 ms per token,   500.00 tokens per second)",
          file=sys.stderr)
    print(f"llama_perf_context_print:        eval time =      {gen_n * 10.0:.2f} ms / "
          f"{gen_n:5d} runs   (   10.00 ms per token,   100.00 tokens per second)",
          file=sys.stderr)
'''

# llama-completion / llama-cli: answers with the prompt's last word, upper-cased.
FAKE_LLAMA_CLI = _PRELUDE + r'''
args, _ = parse({"-m", "-f", "-n", "--temp", "--seed"}, {"--no-display-prompt", "-no-cnv"})
need_gguf(args["-m"])
prompt = open(args["-f"], encoding="utf-8").read()
maybe_fail(prompt)
time.sleep(float(os.environ.get("FAKE_LLAMA_DELAY", "0.05")))
words = prompt.replace("?", " ").replace(".", " ").split()
print("main: build = 4242 (fake)", file=sys.stderr)
print((words[-1] if words else "").upper())
perf(len(words) or 1, int(args["-n"]))
'''

FAKE_LLAMA_BENCH = _PRELUDE + r'''
args, _ = parse({"-m", "-p", "-n", "-r", "-o"})
need_gguf(args["-m"])
maybe_fail()
time.sleep(0.05)
reps = int(args["-r"])
rate = float(os.environ.get("FAKE_BENCH_TG", "25.0"))
rates_file = os.environ.get("FAKE_BENCH_TG_FILE")
if rates_file:  # one rate a start, in order (the last one stays): a run that slows down
    rates = open(rates_file).read().split()
    rate = float(rates[0])
    open(rates_file, "w").write("\n".join(rates[1:] or rates))
print("llama-bench: warming up", file=sys.stderr)
print(json.dumps([
    {"build_commit": "abc123", "model_type": "llama 1B Q4_0", "n_prompt": int(args["-p"]),
     "n_gen": 0, "avg_ts": 200.0, "samples_ts": [200.0] * reps},
    {"build_commit": "abc123", "model_type": "llama 1B Q4_0", "n_prompt": 0,
     "n_gen": int(args["-n"]), "avg_ts": rate, "samples_ts": [rate] * reps},
], indent=2))
'''

# llama-mtmd-cli: an image file "FAKEIMG:<label>" shows a <label>.
FAKE_MTMD_CLI = _PRELUDE + r'''
args, _ = parse({"-m", "--mmproj", "--image", "-p", "-n", "--temp"})
need_gguf(args["-m"])
need_gguf(args["--mmproj"])
data = open(args["--image"], "rb").read()
maybe_fail(data.decode("latin-1"))
time.sleep(0.05)
label = data.split(b":", 1)[1].decode() if data.startswith(b"FAKEIMG:") else "blur"
print(f"This image shows a {label}.")
perf(300, 8)
'''

# whisper-cli: what it "hears" depends on the WAV's length: 1 s "hello world", else more.
FAKE_WHISPER_CLI = _PRELUDE + r'''
import wave
args, _ = parse({"-m", "-f", "-l"}, {"-nt", "-np"})
need_gguf(args["-m"])
with wave.open(args["-f"], "rb") as audio:
    seconds = audio.getnframes() / audio.getframerate()
maybe_fail(args["-f"])
time.sleep(0.05)
print(" hello world" if seconds < 1.5 else " good morning world")
'''

# llama-embedding: a letter-count vector per line of the -f file, JSON on stdout.
FAKE_LLAMA_EMBEDDING = _PRELUDE + r'''
args, _ = parse({"-m", "-f", "--embd-output-format"})
need_gguf(args["-m"])
texts = open(args["-f"], encoding="utf-8").read().split("\n")
maybe_fail("\n".join(texts))
time.sleep(0.05)
data = []
for index, text in enumerate(texts):
    vector = [float(text.lower().count(c)) for c in "abcdefghijklmnopqrstuvwxyz"]
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    data.append({"object": "embedding", "index": index, "embedding": [v / norm for v in vector]})
print("llama_model_loader: loaded meta data", file=sys.stderr)
print(json.dumps({"object": "list", "data": data}))
'''

# llama-server: /health answers 503 while "loading", then 200; logs a line per request.
FAKE_LLAMA_SERVER = _PRELUDE + r'''
import signal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args, _ = parse({"-m", "--host", "--port", "-c"})
need_gguf(args["-m"])
maybe_fail()
ready_at = time.monotonic() + 0.3
def log(line):
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        log(f"srv  log_server_r: request: {self.command} {self.path} "
            f"{self.client_address[0]} {status}")
    def do_GET(self):
        if self.path == "/health":
            self.reply(200 if time.monotonic() > ready_at else 503, {"status": "ok"})
        else:
            self.reply(404, {"error": "not found"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/completion":
            self.reply(200, {"content": body["prompt"].split()[-1].upper()})
        else:
            self.reply(404, {"error": "not found"})
server = ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
log(f"main: server is listening on http://{args['--host']}:{args['--port']}")
server.serve_forever()
'''

# llama-quantize IN OUT TYPE: a smaller "GGUF" naming the type and the input it came from.
FAKE_LLAMA_QUANTIZE = _PRELUDE + r'''
import hashlib
_, rest = parse(set())
source, dest, kind = rest[:3]
need_gguf(source)
if kind not in ("Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0", "F16"):
    print(f"main: invalid ftype '{kind}'", file=sys.stderr)
    sys.exit(1)
time.sleep(0.05)
digest = hashlib.sha256(open(source, "rb").read()).hexdigest()[:16]
open(dest, "wb").write(b"GGUF" + f" {kind} of {digest}".encode())
print(f"llama_model_quantize_impl: model size = 1.00 MB -> {kind}")
'''

# convert_hf_to_gguf.py DIR --outfile OUT --outtype f16
FAKE_CONVERT = _PRELUDE + r'''
args, rest = parse({"--outfile", "--outtype"})
folder = rest[0]
config = json.load(open(os.path.join(folder, "config.json")))
maybe_fail(json.dumps(config))
time.sleep(0.05)
open(args["--outfile"], "wb").write(
    b"GGUF" + f" converted {config.get('model_type')} {args['--outtype']}".encode())
print("INFO:hf-to-gguf:Model successfully exported", file=sys.stderr)
'''

FAKES = {
    "llama-completion": FAKE_LLAMA_CLI, "llama-bench": FAKE_LLAMA_BENCH,
    "llama-mtmd-cli": FAKE_MTMD_CLI, "whisper-cli": FAKE_WHISPER_CLI,
    "llama-embedding": FAKE_LLAMA_EMBEDDING, "llama-server": FAKE_LLAMA_SERVER,
    "llama-quantize": FAKE_LLAMA_QUANTIZE, "convert_hf_to_gguf.py": FAKE_CONVERT,
}


def install_fakes(bin_dir: Path, names: tuple[str, ...] | None = None) -> Path:
    """Every fake (or the named ones) as an executable in bin_dir; returns bin_dir."""
    for name, body in FAKES.items():
        if names is None or name in names:
            make_tool(bin_dir, name, body)
    return bin_dir


def wav_bytes(seconds: float, rate: int = 8000) -> bytes:
    """A real mono 16-bit WAV of silence."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as audio:
        audio.setnchannels(1)
        audio.setsampwidth(2)
        audio.setframerate(rate)
        audio.writeframes(b"\x00\x00" * int(seconds * rate))
    return buffer.getvalue()


def hf_zip(model_type: str = "llama") -> bytes:
    """A zip of a Hugging Face model folder, as model-convert takes one."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as bundle:
        bundle.writestr("tiny/config.json", json.dumps({"model_type": model_type}))
        bundle.writestr("tiny/model.safetensors", b"\x00" * 64)
    return buffer.getvalue()


def jsonl(records: list) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
