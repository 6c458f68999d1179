"""Server toolkit: load client bundles as teachers, synthesize data, distill a global student."""
