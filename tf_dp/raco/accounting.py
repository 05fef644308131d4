"""RaCO-DP's accounting: one subsampled (Gaussian, Laplace) mechanism per step. The
implementation lives in ``tf_dp.accounting.gaussian_laplace`` (accounting is one package)."""

from tf_dp.accounting.gaussian_laplace import (  # noqa: F401
    HISTOGRAM_MECHANISMS,
    INTEGER_RDP_ORDERS,
    JointBaseLoss,
    TAIL_MASS,
    calibrate_noise_multiplier,
    calibrate_steps,
    compute_epsilon,
    effective_noise_multiplier,
    epsilon_of_phases,
    gaussian_rdp,
    joint_step_pld,
    laplace_rdp,
    poisson_subsampled_rdp,
)
