"""The atoll controller: worker registry, compiler, gang scheduler and dispatcher."""
