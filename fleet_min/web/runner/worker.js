// Runs synthetic benchmark iterations off the page's main thread, so the page stays responsive
// and a hidden tab's timer throttling does not slow the measurement.
//
// The synthetic benchmark (docs/web.md, spec decisions): one token is 1,000 chained SHA-256
// rounds; the chain starts at SHA-256("fleet-synthetic:<prompt_tokens>:<gen_tokens>"); an
// iteration runs prompt_tokens tokens (prefill) then gen_tokens tokens (decode) from that start.
import { sha256, chain, hex } from "./sha256.js";

const ROUNDS_PER_TOKEN = 1000;

const backends = {
  jssha: {
    start: (text) => sha256(new TextEncoder().encode(text)),
    tokens: async (digest, n) => chain(digest, n * ROUNDS_PER_TOKEN),
  },
  webcrypto: {
    start: async (text) => new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text))),
    tokens: async (digest, n) => {
      let d = digest;
      for (let i = 0; i < n * ROUNDS_PER_TOKEN; i += 1) d = await crypto.subtle.digest("SHA-256", d);
      return new Uint8Array(d);
    },
  },
};

const round3 = (x) => Math.round(x * 1000) / 1000;

async function iteration(backend, p, g) {
  const impl = backends[backend];
  let digest = await impl.start(`fleet-synthetic:${p}:${g}`);
  const t0 = performance.now();
  digest = await impl.tokens(digest, p);
  const prefillS = (performance.now() - t0) / 1000;
  digest = await impl.tokens(digest, Math.min(1, g));
  const firstTokenS = (performance.now() - t0) / 1000;
  digest = await impl.tokens(digest, Math.max(0, g - 1));
  const decodeS = (performance.now() - t0) / 1000 - prefillS;
  const metrics = {
    ttft_ms: round3(firstTokenS * 1000),
    synthetic_rounds: (p + g) * ROUNDS_PER_TOKEN,
    synthetic_digest: hex(digest),
  };
  if (p) metrics.prefill_tok_s = round3(p / Math.max(prefillS, 1e-9));
  if (g) metrics.decode_tok_s = round3(g / Math.max(decodeS, 1e-9));
  return metrics;
}

self.addEventListener("message", async (ev) => {
  const { id, backend, prompt_tokens: p, gen_tokens: g } = ev.data;
  try {
    if (!backends[backend]) throw new Error(`this page does not implement the backend ${backend}`);
    const metrics = await iteration(backend, p, g);
    self.postMessage({ id, metrics });
  } catch (err) {
    self.postMessage({ id, error: String(err && err.message ? err.message : err) });
  }
});
