-- Drops the topic's messages, forwarded or not, and every group's position.
DROP TABLE IF EXISTS {{ident .Schema .Offsets}};
DROP TABLE IF EXISTS {{ident .Schema .Messages}};
