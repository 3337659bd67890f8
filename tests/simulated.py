"""The environment of a test subprocess that runs JAX on several simulated CPU devices (the device count is
fixed when JAX starts, so such a test runs its script in a fresh interpreter)."""

import os


def cpu_devices_env(devices: int) -> dict[str, str]:
    """This process's environment with JAX on `devices` CPU devices; the run's other XLA flags (`conftest`) kept."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
