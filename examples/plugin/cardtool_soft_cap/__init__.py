"""cardtool's entry point `cardtool.backends` calls `register(components, kernels)` once per process. Targets stay
strings: nothing here is imported until a cell is resolved or parity runs."""


def register(components, kernels):
    # the numpy oracle: the terminal rung of every CPU chain, and what parity compares the other cells with
    kernels.register("soft_cap", "numpy", "generic", "default", target="cardtool_soft_cap.ops:numpy_soft_cap",
                     reference=True)
    kernels.register("soft_cap", "cpu", "generic", "default", target="cardtool_soft_cap.ops:soft_cap",
                     requires=("torch",))
    kernels.register("soft_cap", "cuda", "generic", "default", target="cardtool_soft_cap.ops:soft_cap",
                     requires=("torch",))
    # the inputs every cell of the op runs on; tolerances only where the op's conditioning needs its own (the
    # table's bfloat16 default would do for tanh: declared here to show where one goes)
    kernels.register_inputs("soft_cap", target="cardtool_soft_cap.ops:parity_inputs",
                            tolerances={"bfloat16": (2e-2, 3e-2)})
