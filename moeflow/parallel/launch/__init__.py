"""The job runtime: torchrun's environment, stores and local launches (``torchrun``), the agent
``--nproc`` starts (``agent``) and the ranks' heartbeat that turns a stalled rank into a clear
failure (``heartbeat``). Import from the modules."""
