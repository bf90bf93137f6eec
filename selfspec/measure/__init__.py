"""Measuring selfspec: side-by-side speed (`bench`, its `contenders` and `prompts`), the greedy check in half precision
(`ties`), the costs c and v (`costs`), the choice of gamma, exit layer and tree (`tune`) and held-out figures of
trained heads (`profile`)."""
