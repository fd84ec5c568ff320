//! Dot products between weight blocks and activation blocks.
//! OWNED BY THE KERNELS HELPER: being written.
