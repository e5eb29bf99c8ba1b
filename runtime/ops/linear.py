"""linear: out = (x * pre_quant_scale) @ weight.T; weight [out, in] decoded from any stored format."""



def run(op, buf, w):
    name = op["weight"]
    x = buf[op["x"]]
    pq = w.pre_quant.get(name)
    if pq is not None:
        x = x * pq
    buf[op["out"]][...] = x @ w[name].T          # (matmul with out= misses the BLAS path here)
