// Runs synthetic benchmark iterations off the page's main thread, so the page stays responsive
// and a hidden tab's timer throttling does not slow the measurement.
//
// The synthetic benchmark (decisions.md; docs/agent.md has the same loop in the agent): a
// 4,096-byte block starts with byte i = (i * 31) & 0xff; one round hashes the whole block with
// SHA-256 and writes the digest over its first 32 bytes; one token is 1,000 rounds. The block is
// made once per job and keeps its state across the job's iterations. An iteration runs
// prompt_tokens tokens (prefill), one token (the first), then gen_tokens - 1 tokens.
// The attestation: the hex SHA-256 of a fresh block after 1,000 rounds.
import { sha256, blockRounds, wordsOf, bytesOf, hex, BLOCK_BYTES } from "./sha256.js";

const ROUNDS_PER_TOKEN = 1000;
const ATTESTATION_ROUNDS = 1000;

function freshBlock() {
  const block = new Uint8Array(BLOCK_BYTES);
  for (let i = 0; i < BLOCK_BYTES; i += 1) block[i] = (i * 31) & 0xff;
  return block;
}

// A backend holds the block in its own form (jssha: big-endian words; webcrypto: the bytes).
const backends = {
  jssha: {
    load: (bytes) => wordsOf(bytes),
    rounds: async (state, n) => blockRounds(state, n),
    digest: async (state) => sha256(bytesOf(state)),
  },
  webcrypto: {
    load: (bytes) => bytes,
    rounds: async (state, n) => {
      for (let i = 0; i < n; i += 1) {
        state.set(new Uint8Array(await crypto.subtle.digest("SHA-256", state)), 0);
      }
    },
    digest: async (state) => new Uint8Array(await crypto.subtle.digest("SHA-256", state)),
  },
};

const round3 = (x) => Math.round(x * 1000) / 1000;
let current = null;  // { backend, state }: the running job's block

async function iteration(impl, state, p, g) {
  const t0 = performance.now();
  await impl.rounds(state, p * ROUNDS_PER_TOKEN);
  const t1 = performance.now();
  await impl.rounds(state, Math.min(1, g) * ROUNDS_PER_TOKEN);
  const t2 = performance.now();
  await impl.rounds(state, Math.max(0, g - 1) * ROUNDS_PER_TOKEN);
  const t3 = performance.now();
  const prefillMs = t1 - t0;
  const firstMs = t2 - t1;
  const restMs = t3 - t2;
  return {
    prefill_tok_s: round3((p * 1000) / Math.max(prefillMs, 1)),
    decode_tok_s: round3((g * 1000) / Math.max(firstMs + restMs, 1)),
    ttft_ms: round3(prefillMs + firstMs),
  };
}

async function attest(impl) {
  const state = impl.load(freshBlock());
  await impl.rounds(state, ATTESTATION_ROUNDS);
  return { synthetic_rounds: ATTESTATION_ROUNDS, synthetic_digest: hex(await impl.digest(state)) };
}

self.addEventListener("message", async (ev) => {
  const { id, op, backend, fresh, prompt_tokens: p, gen_tokens: g } = ev.data;
  try {
    const impl = backends[backend];
    if (!impl) throw new Error(`this page does not implement the backend ${backend}`);
    if (op === "attest") {
      self.postMessage({ id, metrics: await attest(impl) });
      return;
    }
    if (fresh || !current || current.backend !== backend) {
      current = { backend, state: impl.load(freshBlock()) };
    }
    self.postMessage({ id, metrics: await iteration(impl, current.state, p, g) });
  } catch (err) {
    self.postMessage({ id, error: String(err && err.message ? err.message : err) });
  }
});
