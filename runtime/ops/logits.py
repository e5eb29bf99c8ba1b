"""logits: out = x @ weight[rows].T: the output head, or the tied embedding; `rows` [start, stop]
takes a rank's share of the vocabulary from a replicated table."""



def run(op, buf, w):
    table = w[op["weight"]]
    if "rows" in op:
        table = table[op["rows"][0]:op["rows"][1]]
    buf[op["out"]][...] = buf[op["x"]] @ table.T
