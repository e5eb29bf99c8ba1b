// verify_keep: the end of a verify pass (the plan's verify program, speculative decoding), the
// contract of NumpyExecutor.keep with the accepted count decided on the device. Rows 0..n-1 of the
// pass are one slot's next tokens (row 0 the slot's next token, rows 1.. the drafted ones; rows at
// negative positions are inactive and come after the active ones). The greedy rule: row i+1 is kept
// while its token equals row i's greedy pick (next_token[i]), so keep = 1 + the drafted tokens that
// match, in order (runtime/draft.py accepted). Then each recurrent state of the slot (a conv window,
// a delta-rule state) is set to its history row keep-1, the state after the last kept row; with
// keep == n the op already left that state. KV rows past the kept ones are never read (they lie
// past the slot's length) and are overwritten by the next pass.
//
// forced >= 0 (a launch outside the graph): keep = forced + 1, whatever the tokens (the caller kept
// fewer, e.g. a pick of masked logits). keep_out[0]: the count decided (graph launches only).
// Grid: x = blocks over a state's 4-byte words, y = the state (entry e: src = its history [rows,
// words[e]], dst = the state [slots, words[e]]).

typedef unsigned int u32;

__global__ void __launch_bounds__(256) verify_keep_k(
    const int *__restrict__ tokens, const int *__restrict__ next_token, const int *__restrict__ pos,
    const int *__restrict__ slot, int rows, const unsigned long long *__restrict__ src,
    const unsigned long long *__restrict__ dst, const long long *__restrict__ words, int nstates, int forced,
    int *__restrict__ keep_out) {
  int n = 0;
  while (n < rows && pos[n] >= 0) n++;
  int keep = forced + 1;
  if (forced < 0) {
    keep = n > 0 ? 1 : 0;
    while (keep < n && next_token[keep - 1] == tokens[keep]) keep++;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) keep_out[0] = keep;
    if (keep == n) return;                           // all kept (or no row): the states are row n-1's
  }
  const int e = blockIdx.y;
  if (keep < 1 || e >= nstates) return;
  const long long nw = words[e];
  const u32 *from = reinterpret_cast<const u32 *>(src[e]) + (long long)(keep - 1) * nw;
  u32 *to = reinterpret_cast<u32 *>(dst[e]) + (long long)slot[0] * nw;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nw; i += (long long)gridDim.x * blockDim.x)
    to[i] = from[i];
}
