"""hc_inject: the residual of qwen4_exp's hyper-connection (Qwen4ExpTextDecoderLayer.forward:
`hyper_input + (y.unsqueeze(-2) * injection_weights.unsqueeze(-1)).flatten(-2)`): the block's
output y goes into every stream i with the stream's scalar weight,

    out_i = x_i + w_i * y

Keys: x f32 [rows, n*D] (the un-normed streams, stream i at columns [i*D, (i+1)*D)), y f32
[rows, D] (the block's output), w f32 [rows, n] (the injection weights, `2*sigmoid(inject/n)`:
act_scale's output); out f32 [rows, n*D] (may be x); attr n."""


def run(op, buf, w):
    x, y, g = buf[op["x"]], buf[op["y"]], buf[op["w"]]
    n = int(op["n"])
    rows = x.shape[0]
    buf[op["out"]][...] = (x.reshape(rows, n, -1) + y[:, None, :] * g[:, :, None]).reshape(rows, -1)
