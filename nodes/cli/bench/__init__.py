"""`python -m comfy_metal bench`: one module a capability, each with `bench(quick: bool) -> list[Table]`."""
