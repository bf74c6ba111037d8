"""Plans and layer styles for models of other libraries; each submodule imports its library
only when used (`import haloshard` imports none of them)."""
