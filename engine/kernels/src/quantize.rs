//! Quantisation of f32 activations to Q8_0 / Q8_1 / Q8_K blocks (fast mode).
//! OWNED BY THE KERNELS HELPER: being written.
