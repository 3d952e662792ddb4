//! Reference normal-mode dispatch/combine over all ranks in one process.
