// SHA-256 written in the page (the `jssha` backend): FIPS 180-4, no platform crypto.
// `blockRounds` is the synthetic benchmark's inner loop (decisions.md): each round hashes the
// whole 4,096-byte block and writes the digest over its first 32 bytes. The block is kept as
// big-endian 32-bit words, so a round copies no bytes and allocates nothing; its padding (a
// 65th 64-byte chunk: 0x80, zeros, the length 32,768 bits) never changes.

const K = new Int32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);
const IV = [0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19];

// Compress one 64-byte block (its 16 words already in w[0..15]) into the state h.
function compress(h, w) {
  for (let i = 16; i < 64; i += 1) {
    const x = w[i - 15];
    const y = w[i - 2];
    const s0 = ((x >>> 7) | (x << 25)) ^ ((x >>> 18) | (x << 14)) ^ (x >>> 3);
    const s1 = ((y >>> 17) | (y << 15)) ^ ((y >>> 19) | (y << 13)) ^ (y >>> 10);
    w[i] = (w[i - 16] + s0 + w[i - 7] + s1) | 0;
  }
  let a = h[0]; let b = h[1]; let c = h[2]; let d = h[3];
  let e = h[4]; let f = h[5]; let g = h[6]; let k = h[7];
  for (let i = 0; i < 64; i += 1) {
    const S1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
    const t1 = (k + S1 + ((e & f) ^ (~e & g)) + K[i] + w[i]) | 0;
    const S0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
    const t2 = (S0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
    k = g; g = f; f = e; e = (d + t1) | 0; d = c; c = b; b = a; a = (t1 + t2) | 0;
  }
  h[0] = (h[0] + a) | 0; h[1] = (h[1] + b) | 0; h[2] = (h[2] + c) | 0; h[3] = (h[3] + d) | 0;
  h[4] = (h[4] + e) | 0; h[5] = (h[5] + f) | 0; h[6] = (h[6] + g) | 0; h[7] = (h[7] + k) | 0;
}

function toBytes(h) {
  const out = new Uint8Array(32);
  for (let i = 0; i < 8; i += 1) {
    out[i * 4] = h[i] >>> 24; out[i * 4 + 1] = h[i] >>> 16; out[i * 4 + 2] = h[i] >>> 8; out[i * 4 + 3] = h[i];
  }
  return out;
}

// SHA-256 of any bytes.
export function sha256(bytes) {
  const bitLength = bytes.length * 8;
  const padded = new Uint8Array(Math.ceil((bytes.length + 9) / 64) * 64);
  padded.set(bytes);
  padded[bytes.length] = 0x80;
  const view = new DataView(padded.buffer);
  view.setUint32(padded.length - 8, Math.floor(bitLength / 2 ** 32));
  view.setUint32(padded.length - 4, bitLength >>> 0);
  const h = Int32Array.from(IV);
  const w = new Int32Array(64);
  for (let off = 0; off < padded.length; off += 64) {
    for (let i = 0; i < 16; i += 1) w[i] = view.getInt32(off + i * 4);
    compress(h, w);
  }
  return toBytes(h);
}

export const BLOCK_BYTES = 4096;
const BLOCK_WORDS = BLOCK_BYTES / 4;
const PADDING = new Int32Array(16);
PADDING[0] = 0x80000000 | 0;
PADDING[15] = BLOCK_BYTES * 8;

// The block's bytes as big-endian words, and back.
export function wordsOf(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.length);
  const words = new Int32Array(bytes.length / 4);
  for (let i = 0; i < words.length; i += 1) words[i] = view.getInt32(i * 4);
  return words;
}

export function bytesOf(words) {
  const bytes = new Uint8Array(words.length * 4);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < words.length; i += 1) view.setInt32(i * 4, words[i]);
  return bytes;
}

// `rounds` rounds over a block held as words (changed in place).
export function blockRounds(words, rounds) {
  if (words.length !== BLOCK_WORDS) throw new Error(`a synthetic block has ${BLOCK_BYTES} bytes`);
  const w = new Int32Array(64);
  const h = new Int32Array(8);
  for (let r = 0; r < rounds; r += 1) {
    h.set(IV);
    for (let off = 0; off < BLOCK_WORDS; off += 16) {
      w.set(words.subarray(off, off + 16));
      compress(h, w);
    }
    w.set(PADDING);
    compress(h, w);
    words.set(h, 0);
  }
}

export function hex(bytes) {
  let s = "";
  for (const b of bytes) s += b.toString(16).padStart(2, "0");
  return s;
}
