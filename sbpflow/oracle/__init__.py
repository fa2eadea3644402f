"""The oracle: a one-device trainer on whole arrays with its own reverse-mode autodiff, optimizer step and loss scaler, sharing none of the compiler's passes; every layout is tested against it."""
