# Types of the Cython module step_inputs.pyx (the type checker does not read .pyx).
import numpy as np

def build_step_arrays(
    tables: np.ndarray,
    block_size: int,
    rows: list[int],
    starts: list[int],
    counts: list[int],
    prompts: list[list[int]],
    outputs: list[list[int]],
    samples: list[bool],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...
