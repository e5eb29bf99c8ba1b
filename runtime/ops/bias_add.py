"""bias_add: out = x + bias (a linear's bias, float32 as decoded; GLM-4.5's q/k/v bias)."""

import numpy as np


def run(op, buf, w):
    np.add(buf[op["x"]], w[op["bias"]], out=buf[op["out"]])
